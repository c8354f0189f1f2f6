"""Qwen-Image 2.1's torch code for the generic LoRA trainer loop (text to image).

The loop owns noise, the sigma draw and the flow-matching target; this module owns what only
Qwen-Image 2.1 knows, through ``QwenImage21Pipeline``'s own pieces so a LoRA sees at training
time what the pipeline feeds its transformer at inference:

* prompts: the pipeline's ``encode_prompt`` (its text-to-image template through Qwen3-VL, the
  last layer's hidden states before the final norm, the system prompt's tokens dropped), its
  mask and its image-slot mask (all text here);
* images: its four-channel VAE (RGBA). Training images are read as RGB (the trainer's reader),
  so they go in opaque: alpha 1 everywhere, as the pipeline reads an RGB reference. One frame
  through the video VAE, its mean normalised by the VAE's latent mean and std
  (``_encode_vae_image``);
* the model call: the latents flattened unpatched (``_pack_latents``), the target's slots
  appended to the image-slot mask (one per 2x2 tokens), the sigma as the timestep (the
  pipeline's ``t / 1000``), no KV cache; the velocity it predicts is ``noise - x0``, what its
  flow-matching scheduler steps with.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["encode_images", "encode_prompts", "predict"]


def encode_prompts(pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``prompt_embeds`` [B, L, D], their bool ``prompt_embeds_mask`` and ``image_pad_mask`` [B, L] (no grad)."""
    with torch.no_grad():
        embeds, mask, slots = pipe.encode_prompt(prompt=list(prompts), device=device)
    if mask is None:  # nothing padded: the pipeline drops an all-true mask
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=device)
    return {"prompt_embeds": embeds.to(device, dtype), "prompt_embeds_mask": mask.to(device),
            "image_pad_mask": slots.to(device)}


def encode_images(pipe: Any, pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` pixels in [-1, 1] (opaque) to normalised latents ``[B, 64, H/16, W/16]``."""
    vae = pipe.vae
    with torch.no_grad():
        opaque = torch.ones_like(pixels[:, :1])  # alpha 1 in [-1, 1]
        frames = torch.cat([pixels, opaque], dim=1).to(dtype=vae.dtype).unsqueeze(2)
        latents = pipe._encode_vae_image(frames, generator=None)
    return latents[:, :, 0].to(dtype=pixels.dtype)


def predict(pipe: Any, denoiser: Any, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
            conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
    """The velocity for ``noisy_latents`` [B, 64, h, w] at sigmas ``timesteps`` [B]."""
    embeds = conditioning["prompt_embeds"]
    batch, channels, height, width = noisy_latents.shape
    packed = pipe._pack_latents(noisy_latents.to(embeds.dtype), batch, channels, height, width)
    slots = conditioning["image_pad_mask"]
    slots = torch.cat([slots, slots.new_ones(batch, height * width // 4)], dim=1)
    mask = conditioning["prompt_embeds_mask"]
    out = denoiser(hidden_states=packed, encoder_hidden_states=embeds,
                   timestep=timesteps.to(noisy_latents.device, embeds.dtype), img_shapes=[[(1, height, width)]] * batch,
                   img_mask=slots, encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                   return_dict=False)[0]
    velocity = out[:, -height * width:]
    return velocity.transpose(1, 2).reshape(batch, channels, height, width).to(noisy_latents.dtype)
