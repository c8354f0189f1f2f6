"""FLUX.2's torch code for the generic LoRA trainer loop (klein's Qwen3 encoder, dev's Mistral-3).

The loop owns noise, timestep sampling, the flow-matching target and the optimiser; this
module owns what only FLUX.2 knows, mirroring ``diffusers.Flux2KleinPipeline`` so a LoRA
trained here sees what the pipeline feeds the transformer at inference:

- prompts: the pipeline's own ``encode_prompt`` (the Qwen3 chat template, the hidden states of
  three layers stacked, padded to 512 positions) and its 4-D text position ids;
- images: the VAE posterior's mode, patchified 2x2 into 128 channels and normalised by the
  VAE's batch-norm statistics (what the pipeline undoes before decoding): model-space latents
  ``[B, 128, H/16, W/16]``;
- the transformer: those latents packed into tokens with the pipeline's 4-D image ids, the
  sigma as the timestep (the pipeline passes ``t / 1000``), and the tokens unpacked back. klein
  has no guidance embedding (it is guided by CFG or distilled to none); dev's transformer is
  guidance-distilled and gets :data:`DEFAULT_TRAINING_GUIDANCE` per sample, as FLUX.1-dev does.

``encode_prompt`` is each pipeline's own (klein: Qwen3 layers 9/18/27; dev: Mistral-3's chat
template and layers 10/20/30), so one module serves both.

klein trains on its undistilled base (``flux.2-klein-base-4b``); the LoRA loads on the
4-step distilled model too, whose modules are the same.
"""

from __future__ import annotations

from typing import Any

import torch

#: Where the prompt is padded to: the pipelines' default ``max_sequence_length``.
DEFAULT_MAX_SEQUENCE_LENGTH = 512
#: The distilled guidance a guidance-embedding transformer (dev) trains under: 1.0, the common
#: FLUX LoRA-training choice (FLUX.1's runtime uses the same, with its sources).
DEFAULT_TRAINING_GUIDANCE = 1.0


def encode_prompts(pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``prompt_embeds`` [B, L, D] and ``text_ids`` [B, L, 4], as the pipeline computes them (no grad)."""
    with torch.no_grad():
        embeds, text_ids = pipe.encode_prompt(prompt=list(prompts), device=device, num_images_per_prompt=1,
                                              max_sequence_length=DEFAULT_MAX_SEQUENCE_LENGTH)
    return {"prompt_embeds": embeds.to(device=device, dtype=dtype), "text_ids": text_ids.to(device)}


def encode_images(pipe: Any, pixels: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Model-space latents [B, 128, H/16, W/16] for pixels [B, 3, H, W] in [-1, 1] (no grad):
    the posterior's mode (the pipeline's own image encoding takes it), patchified and
    normalised by the VAE's batch-norm statistics, as ``Flux2KleinPipeline`` prepares them."""
    vae = pipe.vae
    with torch.no_grad():
        latents = vae.encode(pixels.to(dtype=vae.dtype)).latent_dist.mode()
        latents = pipe._patchify_latents(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                              latents.dtype)
        return (latents - mean) / std


def predict(pipe: Any, denoiser: torch.nn.Module, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
            conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
    """The flow-matching velocity for latents [B, 128, h, w] at sigmas ``timesteps`` [B]: packed
    into tokens with the pipeline's image ids, through ``denoiser`` (the trainer's peft-wrapped
    module; gradients flow), unpacked back. Inputs in the conditioning's dtype."""
    batch, channels, height, width = noisy_latents.shape
    prompt_embeds = conditioning["prompt_embeds"]
    dtype, device = prompt_embeds.dtype, noisy_latents.device
    tokens = pipe._pack_latents(noisy_latents.to(dtype))
    image_ids = pipe._prepare_latent_ids(noisy_latents).to(device)
    text_ids = conditioning["text_ids"].to(device)
    guidance = (torch.full((batch,), DEFAULT_TRAINING_GUIDANCE, device=device, dtype=torch.float32)
                if pipe.transformer.config.guidance_embeds else None)
    predicted = denoiser(
        hidden_states=tokens,
        timestep=timesteps.to(device=device, dtype=dtype).reshape(batch),
        guidance=guidance,
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids,
        img_ids=image_ids,
        return_dict=False,
    )[0]
    return predicted[:, : height * width].permute(0, 2, 1).reshape(batch, channels, height, width)
