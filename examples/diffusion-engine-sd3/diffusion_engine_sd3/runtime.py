"""Stable Diffusion 3's torch code for the engine's generic LoRA trainer.

Mirrors ``StableDiffusion3Pipeline``: prompts go through its own
``encode_prompt`` (CLIP-L + CLIP-G pooled and hidden states, T5 hidden
states), images through the VAE with SD3's shift and scale, and the
transformer is called on unpacked latents with timesteps on the pipeline's
0..1000 scale (sigma x 1000), predicting the flow-matching velocity.
"""

from __future__ import annotations

import torch

#: Where T5 prompts are padded to while training (the pipeline's default is 256).
MAX_SEQUENCE_LENGTH = 77


def encode_prompts(pipe, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``prompt_embeds`` [B, L, D] and ``pooled_prompt_embeds`` [B, P], frozen encoders, no grad."""
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=device,
            num_images_per_prompt=1, do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
    return {"prompt_embeds": embeds.to(device, dtype), "pooled_prompt_embeds": pooled.to(device, dtype)}


def encode_images(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [-1, 1] -> ``(z - shift) * scale`` latents [B, 16, H/8, W/8] (the
    inverse of what the pipeline does before decoding)."""
    vae = pipe.vae
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    with torch.no_grad():
        latents = vae.encode(pixels.to(dtype=vae.dtype)).latent_dist.sample()
    return (latents - shift) * vae.config.scaling_factor


def predict(
    pipe, denoiser, noisy_latents: torch.Tensor, timesteps: torch.Tensor, conditioning: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The velocity (noise - x0) for latents [B, C, h, w] at sigmas ``timesteps`` in [0, 1].
    Calls ``denoiser`` (the trainer's peft-wrapped module), never ``pipe.transformer``."""
    embeds = conditioning["prompt_embeds"]
    batch = noisy_latents.shape[0]
    return denoiser(
        hidden_states=noisy_latents.to(embeds.dtype),
        timestep=(timesteps.to(noisy_latents.device, embeds.dtype) * 1000).reshape(batch),
        encoder_hidden_states=embeds,
        pooled_projections=conditioning["pooled_prompt_embeds"],
        return_dict=False,
    )[0]
