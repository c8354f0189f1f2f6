"""Qwen-Image: the family's torch code for the generic LoRA trainer loop.

Conventions mirror ``diffusers.QwenImagePipeline`` (and diffusers'
``train_dreambooth_lora_qwen_image.py``) so a LoRA trained through these
functions denoises correctly when loaded back into that pipeline:

* Prompts: the pipeline's own ``encode_prompt`` (chat template, template prefix
  dropped, last hidden state), padded to the batch's longest prompt, with a 0/1
  ``prompt_embeds_mask`` kept alongside.
* Latents: the 3D (video) VAE sees one frame; model space is
  ``(z - latents_mean) / latents_std`` per channel, which is exactly what the
  pipeline's decode (``z / (1 / std) + mean``) inverts. The frame axis is dropped,
  so the trainer sees ``[B, 16, H/8, W/8]``.
* Denoiser: latents are packed into 2x2 patches (``[B, h/2 * w/2, 64]``) with
  ``img_shapes`` for RoPE; the timestep is the flow-matching sigma itself (the
  pipeline passes ``scheduler_t / 1000 == sigma``); the output is already the
  velocity ``noise - x0`` that ``FlowMatchEulerDiscreteScheduler.step`` integrates,
  so no sign flip.
"""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline

__all__ = ["encode_images", "encode_prompt_inputs", "encode_prompts", "predict", "prompt_inputs"]

#: ``QwenImagePipeline.__call__``'s default ``max_sequence_length``: train on the
#: same prompt truncation the pipeline generates with.
_MAX_SEQUENCE_LENGTH: int = 512


def encode_prompts(
    pipe: DiffusionPipeline, prompts: list[str], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Qwen2.5-VL text conditioning for a batch of prompts, computed under ``torch.no_grad()``.

    Returns ``prompt_embeds`` ``[B, L, D]`` in ``dtype`` (``L`` = the longest prompt
    in the batch after the template prefix is dropped, zero-padded) and
    ``prompt_embeds_mask`` ``[B, L]`` (int64, 1 = real token). The mask stays an
    integer tensor whatever ``dtype`` is: it selects tokens, it is not compute.
    ``pipe.encode_prompt`` drops the mask when no prompt is padded; it is rebuilt
    here so the dict always holds the same keys and every value is a tensor.
    """
    with torch.no_grad():
        prompt_embeds, mask = pipe.encode_prompt(
            list(prompts), device=device, max_sequence_length=_MAX_SEQUENCE_LENGTH
        )
    if mask is None:
        mask = torch.ones(prompt_embeds.shape[:2], dtype=torch.long, device=device)
    return {
        "prompt_embeds": prompt_embeds.to(device=device, dtype=dtype),
        "prompt_embeds_mask": mask.to(device=device, dtype=torch.long),
    }



def prompt_inputs(pipe: DiffusionPipeline, kwargs: dict) -> dict | None:
    """What ``QwenImagePipeline``'s prompt encoding depends on in one call (for
    the inference prompt cache, :mod:`engine.runtime.prompt_cache`): the prompts,
    the negatives only when true CFG runs (``true_cfg_scale`` > 1 with a
    negative), and the maximum length. None for an edit call (its prompt is
    encoded with the input image) or a call without text."""
    from engine.contract.family_helpers import prompt_list, true_cfg_prompt_inputs

    prompts = prompt_list(kwargs.get("prompt"))
    if prompts is None or "Edit" in type(pipe).__name__:
        return None
    return true_cfg_prompt_inputs(pipe, kwargs, prompts, _MAX_SEQUENCE_LENGTH)


def encode_prompt_inputs(pipe: DiffusionPipeline, inputs: dict, device: torch.device) -> dict[str, torch.Tensor | None]:
    """The embedding arguments (embeddings and their masks) its call computes
    from ``inputs``, through ``encode_prompt``. A mask the pipeline dropped (no
    prompt padded) is given back as ones: the call drops an all-ones mask again,
    and does not warn that embeddings came without one."""
    out: dict[str, torch.Tensor | None] = {}
    sides = [("", inputs["prompt"])]
    if inputs.get("negative_prompt") is not None:
        sides.append(("negative_", inputs["negative_prompt"]))
    with torch.no_grad():
        for prefix, texts in sides:
            embeds, mask = pipe.encode_prompt(
                prompt=list(texts), device=device, num_images_per_prompt=1,
                max_sequence_length=inputs["max_sequence_length"],
            )
            if mask is None:
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            out[f"{prefix}prompt_embeds"] = embeds
            out[f"{prefix}prompt_embeds_mask"] = mask
    return out


def encode_images(pipe: DiffusionPipeline, pixels: torch.Tensor) -> torch.Tensor:
    """Encode ``[B, 3, H, W]`` pixels in ``[-1, 1]`` to normalised latents ``[B, 16, H/8, W/8]``.

    ``AutoencoderKLQwenImage`` is a video VAE, so the batch goes in as one frame
    (``[B, 3, 1, H, W]``) and the frame axis is squeezed out again. The posterior
    mean is used (deterministic, so latents can be cached; the Qwen/Wan VAE's own
    encoder returns the mean too). Normalisation is ``(z - mean) / std``, the exact
    inverse of the pipeline's decode. Computed under ``torch.no_grad()``; returned
    in ``pixels``' dtype (the per-channel maths runs in float32).
    """
    vae = pipe.vae
    with torch.no_grad():
        frames = pixels.to(dtype=vae.dtype).unsqueeze(2)
        z = vae.encode(frames).latent_dist.mode().float()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=z.device).view(shape)
        std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=z.device).view(shape)
        z = (z - mean) / std
    return z[:, :, 0].to(dtype=pixels.dtype)


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, h/2 * w/2, C * 4]``, as ``QwenImagePipeline._pack_latents``."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def _unpack(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``_pack``, as ``QwenImagePipeline._unpack_latents`` (minus the frame axis)."""
    b, _, d = packed.shape
    c = d // 4
    x = packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def predict(
    pipe: DiffusionPipeline,
    denoiser: torch.nn.Module,
    noisy_latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Velocity prediction ``noise - x0`` for ``noisy_latents`` ``[B, 16, h, w]`` at sigmas ``timesteps`` ``[B]``.

    Calls ``denoiser`` (not ``pipe.transformer``: the trainer may pass a peft- or
    compile-wrapped module) the way ``QwenImagePipeline``'s loop does: packed 2x2
    latents, ``img_shapes = [[(1, h/2, w/2)]] * B``, ``timestep = sigma`` (the
    pipeline's ``t / 1000``, with ``t = sigma * 1000``) in the latent dtype, and no
    guidance embedding (Qwen-Image is not guidance-distilled). The mask is passed
    only when some prompt is padded, as the pipeline does (an all-ones mask gives
    the same result but rules out mask-less attention kernels). The input runs in
    the conditioning's dtype (the compute dtype the trainer encoded prompts in);
    the result comes back in ``noisy_latents``' dtype and layout. Gradients flow.
    """
    prompt_embeds = conditioning["prompt_embeds"]
    mask = conditioning.get("prompt_embeds_mask")
    if mask is not None and bool(mask.all()):
        mask = None
    b, _, h, w = noisy_latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"Qwen-Image latents need even height and width, got {h}x{w}")
    compute_dtype = prompt_embeds.dtype
    hidden_states = _pack(noisy_latents.to(compute_dtype))
    out = denoiser(
        hidden_states=hidden_states,
        timestep=timesteps.to(device=hidden_states.device, dtype=compute_dtype).reshape(b),
        guidance=None,
        encoder_hidden_states=prompt_embeds,
        encoder_hidden_states_mask=mask,
        img_shapes=[[(1, h // 2, w // 2)]] * b,
        return_dict=False,
    )[0]
    return _unpack(out, h, w).to(noisy_latents.dtype)


# -- the training-memory tool (engine.testing.memory_figures) ---------------------------------


def probe_conditioning(config: dict, text_tokens: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One prompt of ``text_tokens`` positions, unpadded: ``predict`` drops an all-ones mask,
    so none is given (a mask is host data, which fake tensors cannot hold)."""
    return {"prompt_embeds": torch.randn(1, text_tokens, config["joint_attention_dim"], dtype=dtype)}
