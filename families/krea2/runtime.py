"""Krea 2's torch code for the generic LoRA trainer loop (text to image).

The loop owns noise, the sigma draw and the flow-matching target; this module owns what only
Krea 2 knows, through ``Krea2Pipeline``'s own pieces so a LoRA sees at training time what the
pipeline feeds its transformer at inference:

* prompts: the pipeline's ``encode_prompt`` (its chat template padded in the middle to a fixed
  512 tokens, the encoder's selected hidden states stacked per token: ``[B, L, layers, D]``)
  and its mask;
* images: the Qwen-Image VAE, shared with that family (``families.qwen_image.runtime``:
  one frame through the video VAE, its mean normalised by the VAE's latent mean and std);
* the model call: the latents packed in 2x2 patches (``_pack_latents``), the rotary positions
  of text and image tokens (``prepare_position_ids``), the sigma as the timestep (the
  pipeline's ``t / 1000``); the velocity it predicts is ``noise - x0``, what its
  flow-matching scheduler steps with.
"""

from __future__ import annotations

from typing import Any

import torch

from families.qwen_image.runtime import encode_images as encode_images

__all__ = ["encode_images", "encode_prompts", "predict"]


def encode_prompts(pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``prompt_embeds`` [B, L, layers, D] and their bool ``prompt_embeds_mask`` [B, L] (no grad)."""
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(prompt=list(prompts), device=device)
    return {"prompt_embeds": embeds.to(device, dtype), "prompt_embeds_mask": mask.to(device)}


def predict(pipe: Any, denoiser: Any, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
            conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
    """The velocity for ``noisy_latents`` [B, 16, h, w] at sigmas ``timesteps`` [B]."""
    embeds = conditioning["prompt_embeds"]
    batch, channels, height, width = noisy_latents.shape
    packed = pipe._pack_latents(noisy_latents.to(embeds.dtype), batch, channels, height, width)
    patch = pipe.patch_size
    positions = pipe.prepare_position_ids(embeds.shape[1], height // patch, width // patch, noisy_latents.device)
    out = denoiser(hidden_states=packed, encoder_hidden_states=embeds,
                   timestep=timesteps.to(noisy_latents.device, embeds.dtype), position_ids=positions,
                   encoder_attention_mask=conditioning["prompt_embeds_mask"], return_dict=False)[0]
    unpacked = out.view(batch, height // patch, width // patch, channels, patch, patch)
    return unpacked.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, height, width).to(noisy_latents.dtype)
