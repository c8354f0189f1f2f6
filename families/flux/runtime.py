"""FLUX.1's torch code for the generic LoRA trainer loop.

The loop owns noise, timestep sampling, the flow-matching target and the
optimiser; this module owns what only FLUX knows: how prompts become the
transformer's text inputs, how images become the latents ``FluxPipeline``
denoises, and how unpacked ``[B, C, h, w]`` latents go through the
transformer (2x2 packing, position ids, timestep and guidance conventions).

Everything mirrors ``diffusers.FluxPipeline`` so that a LoRA trained here sees
at training time exactly what the pipeline feeds it at inference time.
"""

from __future__ import annotations

import torch

# Where the T5 prompt is padded to. FluxPipeline's default (and that of
# diffusers' train_dreambooth_lora_flux.py); T5 runs without an attention mask,
# so the pad length is part of the conditioning and must match inference.
DEFAULT_MAX_SEQUENCE_LENGTH: int = 512

# Distilled guidance fed to guidance-embedding checkpoints (FLUX.1-dev) while
# training. 1.0 is the common LoRA-training choice (diffusers' README example,
# SimpleTuner, ai-toolkit); diffusers' script argument defaults to 3.5.
DEFAULT_TRAINING_GUIDANCE: float = 1.0


def encode_prompts(
    pipe,
    prompts: list[str],
    device: torch.device,
    dtype: torch.dtype,
    *,
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
) -> dict[str, torch.Tensor]:
    """Text conditioning for the transformer, computed once per prompt batch.

    Uses ``pipe.encode_prompt`` itself (CLIP-L pooled output + T5 hidden
    states padded to ``max_sequence_length``) so the conditioning matches what
    the pipeline feeds at inference. Run under ``no_grad`` because the text
    encoders are frozen. Returns batch-first tensors on ``device`` in
    ``dtype``: ``prompt_embeds`` [B, L, D], ``pooled_prompt_embeds`` [B, P]
    and ``text_ids`` [B, L, 3] (the pipeline's [L, 3] ids repeated per sample,
    so the trainer can slice and concatenate conditioning by batch; they are
    all zeros and ``predict`` passes one row to the transformer).
    """
    prompts = list(prompts)
    with torch.no_grad():
        prompt_embeds, pooled_prompt_embeds, text_ids = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=device,
            num_images_per_prompt=1,
            max_sequence_length=max_sequence_length,
        )
    batch = len(prompts)
    return {
        "prompt_embeds": prompt_embeds.to(device=device, dtype=dtype),
        "pooled_prompt_embeds": pooled_prompt_embeds.to(device=device, dtype=dtype),
        "text_ids": text_ids.to(device=device, dtype=dtype).expand(batch, -1, -1).contiguous(),
    }



def prompt_inputs(pipe, kwargs: dict) -> dict | None:
    """What ``FluxPipeline``'s prompt encoding depends on in one call (for the
    inference prompt cache, :mod:`engine.runtime.prompt_cache`): the prompts,
    the negative prompts only when true CFG runs (``true_cfg_scale`` > 1 with a
    negative), and the T5 length. None: a call with a second prompt or no text."""
    from engine.contract.family_helpers import prompt_list, true_cfg_prompt_inputs

    prompts = prompt_list(kwargs.get("prompt"))
    if prompts is None or kwargs.get("prompt_2") is not None or kwargs.get("negative_prompt_2") is not None:
        return None
    return true_cfg_prompt_inputs(pipe, kwargs, prompts, DEFAULT_MAX_SEQUENCE_LENGTH)


def encode_prompt_inputs(pipe, inputs: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The embedding arguments ``FluxPipeline.__call__`` computes from ``inputs``,
    through its own ``encode_prompt`` (the text ids it rebuilds itself: zeros)."""
    out: dict[str, torch.Tensor] = {}
    sides = [("", inputs["prompt"])]
    if inputs.get("negative_prompt") is not None:
        sides.append(("negative_", inputs["negative_prompt"]))
    with torch.no_grad():
        for prefix, texts in sides:
            embeds, pooled, _ = pipe.encode_prompt(
                prompt=list(texts), prompt_2=None, device=device, num_images_per_prompt=1,
                max_sequence_length=inputs["max_sequence_length"],
            )
            out[f"{prefix}prompt_embeds"] = embeds
            out[f"{prefix}pooled_prompt_embeds"] = pooled
    return out


def encode_images(
    pipe, pixels: torch.Tensor, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Model-space latents [B, 16, H/8, W/8] for pixels [B, 3, H, W] in [-1, 1].

    Samples the VAE posterior (as diffusers' FLUX training script does) and
    applies ``(z - shift_factor) * scaling_factor``, the inverse of what
    ``FluxPipeline`` does before decoding (``z / scaling_factor +
    shift_factor``), so the latents are those the transformer denoises,
    before 2x2 packing. Under ``no_grad`` because the VAE is frozen. The
    latents keep the VAE's dtype; the trainer casts them.
    """
    vae = pipe.vae
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    scale = vae.config.scaling_factor
    with torch.no_grad():
        posterior = vae.encode(pixels.to(dtype=vae.dtype)).latent_dist
        latents = posterior.sample(generator=generator)
        return (latents - shift) * scale


def predict(
    pipe,
    denoiser: torch.nn.Module,
    noisy_latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: dict[str, torch.Tensor],
    *,
    guidance: float = DEFAULT_TRAINING_GUIDANCE,
) -> torch.Tensor:
    """The flow-matching velocity prediction for unpacked latents [B, C, h, w].

    ``timesteps`` are sigmas in [0, 1] (shape [B]). FluxPipeline calls the
    transformer with ``timestep = t / 1000`` where ``t = sigma * 1000`` (the
    model multiplies by 1000 inside), so the sigma is passed as is. The
    latents are packed into 2x2 patches with ``pipe._pack_latents``, given the
    pipeline's image position ids (``pipe._prepare_latent_image_ids`` over the
    h/2 x w/2 patch grid), and the output is unpacked back to [B, C, h, w].
    Guidance-distilled checkpoints (``config.guidance_embeds``) get
    ``guidance`` per sample, schnell-style ones get none. ``denoiser`` is
    called rather than ``pipe.transformer`` because the trainer may pass a
    peft-wrapped or compiled module; gradients flow. Inputs are cast to the
    dtype of ``conditioning["prompt_embeds"]`` (the trainer's compute dtype);
    the output keeps the model's dtype.
    """
    batch, channels, height, width = noisy_latents.shape
    if height % 2 or width % 2:
        raise ValueError(
            f"FLUX packs latents in 2x2 patches: latent size {height}x{width} must be even "
            "(image sides must be multiples of 16)"
        )
    prompt_embeds = conditioning["prompt_embeds"]
    dtype = prompt_embeds.dtype
    device = noisy_latents.device

    packed = pipe._pack_latents(noisy_latents.to(dtype), batch, channels, height, width)
    image_ids = pipe._prepare_latent_image_ids(batch, height // 2, width // 2, device, dtype)
    text_ids = conditioning["text_ids"]
    if text_ids.ndim == 3:  # batch-first from encode_prompts; identical rows
        text_ids = text_ids[0]

    config = getattr(denoiser, "config", None) or pipe.transformer.config
    guidance_vec = (
        torch.full((batch,), float(guidance), device=device, dtype=torch.float32)
        if config.guidance_embeds
        else None
    )

    packed_pred = denoiser(
        hidden_states=packed,
        timestep=timesteps.to(device=device, dtype=dtype).reshape(batch),
        guidance=guidance_vec,
        pooled_projections=conditioning["pooled_prompt_embeds"].to(dtype),
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids.to(dtype),
        img_ids=image_ids,
        return_dict=False,
    )[0]

    vae_scale_factor = pipe.vae_scale_factor
    return pipe._unpack_latents(
        packed_pred,
        height=height * vae_scale_factor,
        width=width * vae_scale_factor,
        vae_scale_factor=vae_scale_factor,
    )


# -- the training-memory tool (engine.testing.memory_figures) ---------------------------------


def probe_pipeline(model):  # type: ignore[no-untyped-def]
    """What ``predict`` reads from a FluxPipeline: its static packing helpers and the scale."""
    from types import SimpleNamespace

    from diffusers import FluxPipeline

    return SimpleNamespace(
        vae_scale_factor=8, transformer=model, _pack_latents=FluxPipeline._pack_latents,
        _unpack_latents=FluxPipeline._unpack_latents,
        _prepare_latent_image_ids=FluxPipeline._prepare_latent_image_ids,
    )


def probe_conditioning(config: dict, text_tokens: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What ``encode_prompts`` returns for one prompt of ``text_tokens`` positions: T5 states,
    the pooled CLIP embedding and the text position ids."""
    return {
        "prompt_embeds": torch.randn(1, text_tokens, config["joint_attention_dim"], dtype=dtype),
        "pooled_prompt_embeds": torch.randn(1, config["pooled_projection_dim"], dtype=dtype),
        "text_ids": torch.zeros(1, text_tokens, 3, dtype=dtype),
    }
