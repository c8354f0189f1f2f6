"""Wan's torch code for the generic LoRA trainer loop (text to video).

The loop owns noise, the sigma draw (the family's shift, an expert's range on
a two-expert base) and the flow-matching target; this module owns what only
Wan knows, mirroring ``diffusers.WanPipeline`` so a LoRA sees at training time
what the pipeline feeds it at inference:

* prompts: UMT5 through the pipeline's own ``encode_prompt``, padded to 512
  positions (``WanPipeline``'s default ``max_sequence_length``; the padding is
  zeros after each prompt's tokens, as at inference);
* clips: ``[B, 3, F, H, W]`` pixels in [-1, 1] (an image is one frame) through
  the VAE to ``[B, C, 1 + (F-1)/4, H/s, W/s]`` latents, normalised by the VAE's
  ``latents_mean`` / ``latents_std`` exactly as the pipeline un-normalises them
  before decoding; the posterior's mode (deterministic: a resume re-encodes
  nothing, and two runs cache the same latents);
* the model call: the sigma in [0, 1] as Wan's timestep (x 1000, the
  flow-matching scheduler's ``num_train_timesteps``); the velocity it predicts
  is ``noise - x0``, what ``FlowMatchEulerDiscreteScheduler`` steps with.
"""

from __future__ import annotations

from typing import Any

import torch

#: Where UMT5 prompts are padded to (``WanPipeline.__call__``'s default).
MAX_SEQUENCE_LENGTH: int = 512
#: The flow-matching scheduler's timestep scale (sigma 1.0 is timestep 1000).
TIMESTEP_SCALE: float = 1000.0


def encode_prompts(pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``prompt_embeds`` [B, 512, D] for a batch of captions (no grad)."""
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(
            prompt=list(prompts), do_classifier_free_guidance=False, num_videos_per_prompt=1,
            max_sequence_length=MAX_SEQUENCE_LENGTH, device=device, dtype=dtype,
        )
    return {"prompt_embeds": embeds.to(device=device, dtype=dtype)}


def encode_images(pipe: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents for pixels [B, 3, H, W] (one frame) or [B, 3, F, H, W], in [-1, 1]."""
    vae = pipe.vae
    clip = pixels.unsqueeze(2) if pixels.dim() == 4 else pixels
    with torch.no_grad():
        latents = vae.encode(clip.to(vae.dtype)).latent_dist.mode()
    channels = latents.shape[1]
    mean = torch.tensor(vae.config.latents_mean, dtype=latents.dtype, device=latents.device).view(1, channels, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=latents.dtype, device=latents.device).view(1, channels, 1, 1, 1)
    return (latents - mean) / std


def predict(pipe: Any, denoiser: Any, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
            conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
    """The velocity for ``noisy_latents`` [B, C, f, h, w] at sigmas ``timesteps`` [B]."""
    embeds = conditioning["prompt_embeds"].to(noisy_latents.dtype)
    return denoiser(
        hidden_states=noisy_latents,
        timestep=timesteps.to(noisy_latents.device, torch.float32) * TIMESTEP_SCALE,
        encoder_hidden_states=embeds,
        return_dict=False,
    )[0]


def probe_conditioning(config: dict[str, Any], text_tokens: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The training-memory tool's prompt: ``text_tokens`` UMT5 positions at the model's text width."""
    return {"prompt_embeds": torch.randn(1, text_tokens, int(config["text_dim"]), dtype=dtype)}
