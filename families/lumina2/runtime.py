"""Lumina 2's torch code for the generic LoRA trainer loop (text to image).

The loop owns noise, the sigma draw and the flow-matching target; this module owns what only
Lumina 2 knows, mirroring ``Lumina2Pipeline`` so a LoRA sees at training time what the pipeline
feeds its transformer at inference:

* prompts: the pipeline's ``encode_prompt`` (its system prompt before each caption, Gemma-2's
  second-to-last hidden state, padded to 256 tokens) and its mask;
* images: the FLUX.1 VAE's posterior mode, shifted and scaled as the pipeline un-does it
  before decoding (``(z - shift_factor) * scaling_factor``), ``[B, 16, H/8, W/8]``;
* the model call: the latents as they are (the transformer patches them), the time as
  Lumina's own (``1 - sigma``: its t=0 is noise); it predicts toward the image (the pipeline
  negates it before stepping), so the velocity ``noise - x0`` is its negation.
"""

from __future__ import annotations

from typing import Any

import torch


def encode_prompts(pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``prompt_embeds`` [B, 256, D] and their ``prompt_attention_mask`` [B, 256] (no grad)."""
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False, device=device)
    return {"prompt_embeds": embeds.to(device, dtype), "prompt_attention_mask": mask.to(device)}


def encode_images(pipe: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Scaled latents [B, C, H/8, W/8] for pixels [B, 3, H, W] in [-1, 1]."""
    vae = pipe.vae
    with torch.no_grad():
        latents = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
    return ((latents - vae.config.shift_factor) * vae.config.scaling_factor).to(pixels.dtype)


def predict(pipe: Any, denoiser: Any, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
            conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
    """The velocity for ``noisy_latents`` [B, C, h, w] at sigmas ``timesteps`` [B]."""
    embeds = conditioning["prompt_embeds"]
    out = denoiser(hidden_states=noisy_latents.to(embeds.dtype), timestep=1 - timesteps.to(noisy_latents.device, embeds.dtype),
                   encoder_hidden_states=embeds, encoder_attention_mask=conditioning["prompt_attention_mask"],
                   return_dict=False)[0]
    return (-out).to(noisy_latents.dtype)
