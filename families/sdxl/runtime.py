"""Stable Diffusion XL's torch code for the generic LoRA trainer loop.

The loop owns noise, timestep sampling, the target and the optimiser; this
module owns what only SDXL knows: how prompts become the UNet's two text
inputs (concatenated penultimate CLIP states and the pooled CLIP-G
projection), how images become the latents the pipeline denoises, the UNet's
micro-conditioning (``time_ids``), and the DDPM noise schedule used for
training.

Everything mirrors ``diffusers.StableDiffusionXLPipeline`` so that a LoRA
trained here sees at training time what the pipeline feeds it at inference.
"""

from __future__ import annotations

import torch
from diffusers import DDPMScheduler


def encode_prompts(
    pipe, prompts: list[str], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Text conditioning for the UNet, computed once per prompt batch.

    Uses ``pipe.encode_prompt`` itself (penultimate hidden states of both
    CLIP encoders concatenated, pooled projection of the second) with
    classifier-free guidance off, so the conditioning matches inference.
    Under ``no_grad`` because the text encoders are frozen. Returns
    batch-first tensors on ``device`` in ``dtype``: ``prompt_embeds``
    [B, 77, D1 + D2] and ``pooled_prompt_embeds`` [B, P].
    """
    prompts = list(prompts)
    with torch.no_grad():
        prompt_embeds, _, pooled_prompt_embeds, _ = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
        )
    return {
        "prompt_embeds": prompt_embeds.to(device=device, dtype=dtype),
        "pooled_prompt_embeds": pooled_prompt_embeds.to(device=device, dtype=dtype),
    }



def prompt_inputs(pipe, kwargs: dict) -> dict | None:
    """What ``StableDiffusionXLPipeline``'s prompt encoding depends on in one call
    (for the inference prompt cache, :mod:`engine.runtime.prompt_cache`): the
    prompts, the negatives, whether classifier-free guidance runs (the pipeline's
    own rule: ``guidance_scale`` > 1 on a UNet without a guidance embedding), and
    ``clip_skip``. None: a call with second prompts or no text."""
    from engine.contract.family_helpers import call_value, prompt_list

    prompts = prompt_list(kwargs.get("prompt"))
    if prompts is None or kwargs.get("prompt_2") is not None or kwargs.get("negative_prompt_2") is not None:
        return None
    guidance = float(call_value(pipe, kwargs, "guidance_scale") or 0.0)
    cfg = guidance > 1 and pipe.unet.config.time_cond_proj_dim is None
    return {
        "prompt": prompts,
        "negative_prompt": prompt_list(kwargs.get("negative_prompt")) if cfg else None,
        "cfg": cfg,
        "clip_skip": call_value(pipe, kwargs, "clip_skip"),
    }


def encode_prompt_inputs(pipe, inputs: dict, device: torch.device) -> dict[str, torch.Tensor | None]:
    """The four embedding arguments the pipeline's call computes from ``inputs``,
    through its own ``encode_prompt`` (negatives only under guidance)."""
    with torch.no_grad():
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=list(inputs["prompt"]), prompt_2=None, device=device, num_images_per_prompt=1,
            do_classifier_free_guidance=inputs["cfg"], negative_prompt=inputs["negative_prompt"],
            negative_prompt_2=None, clip_skip=inputs["clip_skip"],
        )
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled,
            "negative_prompt_embeds": negative if inputs["cfg"] else None,
            "negative_pooled_prompt_embeds": negative_pooled if inputs["cfg"] else None}


def encode_images(
    pipe, pixels: torch.Tensor, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Model-space latents [B, 4, H/8, W/8] for pixels [B, 3, H, W] in [-1, 1].

    Samples the VAE posterior (as diffusers' SDXL training scripts do) and
    scales it the inverse of the pipeline's decode: ``(z - latents_mean) *
    scaling_factor / latents_std`` when the VAE config has per-channel
    statistics, else ``z * scaling_factor``. SDXL's original VAE overflows in
    fp16, so a float16 VAE whose config sets ``force_upcast`` is run in
    float32 for the call and put back afterwards, like the pipeline does when
    decoding. Under ``no_grad`` because the VAE is frozen. The latents keep
    the dtype the VAE computed in; the trainer casts them.
    """
    vae = pipe.vae
    config = vae.config
    upcast = vae.dtype == torch.float16 and getattr(config, "force_upcast", False)
    with torch.no_grad():
        if upcast:
            vae.to(dtype=torch.float32)
        try:
            posterior = vae.encode(pixels.to(dtype=vae.dtype)).latent_dist
            latents = posterior.sample(generator=generator)
        finally:
            if upcast:
                vae.to(dtype=torch.float16)
        mean = getattr(config, "latents_mean", None)
        std = getattr(config, "latents_std", None)
        if mean is not None and std is not None:
            like = {"device": latents.device, "dtype": latents.dtype}
            mean_t = torch.tensor(mean, **like).view(1, -1, 1, 1)
            std_t = torch.tensor(std, **like).view(1, -1, 1, 1)
            return (latents - mean_t) * config.scaling_factor / std_t
        return latents * config.scaling_factor


def predict(
    pipe,
    denoiser: torch.nn.Module,
    noisy_latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The UNet's prediction (epsilon or v, per the scheduler) for latents [B, C, h, w].

    ``timesteps`` are integer DDPM timesteps [B], passed as is (the UNet
    embeds them itself). SDXL's micro-conditioning ``time_ids`` is
    ``(original_h, original_w, crop_top, crop_left, target_h, target_w)``
    per sample; without a ``conditioning["time_ids"]`` [B, 6] from the
    trainer, it is built as the pipeline's default: original = target = the
    image size (latent size x ``pipe.vae_scale_factor``), crop (0, 0).
    ``added_cond_kwargs`` carries it with the pooled text embedding.
    ``denoiser`` is called rather than ``pipe.unet`` because the trainer may
    pass a peft-wrapped or compiled module; gradients flow. Inputs are cast
    to the dtype of ``conditioning["prompt_embeds"]`` (the trainer's compute
    dtype); the output keeps the model's dtype and the input layout.
    """
    batch, _, height, width = noisy_latents.shape
    prompt_embeds = conditioning["prompt_embeds"]
    dtype = prompt_embeds.dtype
    device = noisy_latents.device

    time_ids = conditioning.get("time_ids")
    if time_ids is None:
        image_h = height * pipe.vae_scale_factor
        image_w = width * pipe.vae_scale_factor
        row = torch.tensor([image_h, image_w, 0, 0, image_h, image_w], device=device, dtype=dtype)
        time_ids = row.unsqueeze(0).expand(batch, -1)
    added_cond_kwargs = {
        "text_embeds": conditioning["pooled_prompt_embeds"].to(dtype),
        "time_ids": time_ids.to(device=device, dtype=dtype),
    }
    return denoiser(
        noisy_latents.to(dtype),
        timesteps.to(device),
        encoder_hidden_states=prompt_embeds,
        added_cond_kwargs=added_cond_kwargs,
        return_dict=False,
    )[0]


def training_scheduler(pipe) -> DDPMScheduler:
    """The DDPM schedule SDXL was trained with, for the trainer's noising.

    Built from the pipeline's scheduler config (betas, ``num_train_timesteps``,
    ``prediction_type``), as diffusers' SDXL training scripts load
    ``DDPMScheduler`` from the checkpoint's scheduler folder: the inference
    scheduler (Euler) shares the betas, but its ``add_noise`` works in sigma
    space (``x + sigma * noise``, for inputs it rescales later), not the
    ``sqrt(alpha_bar) * x + sqrt(1 - alpha_bar) * noise`` mix the UNet takes
    unscaled during training. The trainer uses its ``add_noise``,
    ``get_velocity`` and ``config.num_train_timesteps``.
    """
    return DDPMScheduler.from_config(pipe.scheduler.config)
