"""Z-Image: the family's torch code for the generic LoRA trainer loop.

Conventions mirror ``diffusers.ZImagePipeline`` so a LoRA trained through these
functions denoises correctly when loaded back into that pipeline:

* Prompts: the pipeline's own ``encode_prompt`` (Qwen3 chat template,
  ``hidden_states[-2]``, padding tokens dropped). It yields one variable-length
  ``[L_i, D]`` tensor per prompt; they are zero-padded into ``cap_feats``
  ``[B, L, D]`` with ``cap_lens`` ``[B]`` so the dict holds tensors only, and
  ``predict`` slices them back, so the transformer sees exactly what the pipeline
  gives it (it pads captions itself, with its learned ``cap_pad_token``).
* Latents: flux-style ``AutoencoderKL``; model space is
  ``(z - shift_factor) * scaling_factor``, the inverse of the pipeline's decode
  ``z / scaling_factor + shift_factor``.
* Denoiser: a list of ``[C, 1, h, w]`` latents (frame axis added, the transformer
  patchifies 2x2 itself); timestep ``1 - sigma`` (the pipeline's
  ``(1000 - t) / 1000`` with ``t = sigma * 1000``: Z-Image counts time from noise
  to image); the output is the *negated* velocity (the pipeline does
  ``noise_pred = -model_out`` before ``scheduler.step``), so it is negated here and
  ``predict`` returns ``noise - x0`` like every other flow-matching family.
"""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline

__all__ = ["encode_images", "encode_prompt_inputs", "encode_prompts", "predict", "prompt_inputs"]

#: ``ZImagePipeline.__call__``'s default ``max_sequence_length`` (the tokenizer's
#: padded length, chat template included): train on the truncation it generates with.
_MAX_SEQUENCE_LENGTH: int = 512


def encode_prompts(
    pipe: DiffusionPipeline, prompts: list[str], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Qwen3 caption features for a batch of prompts, computed under ``torch.no_grad()``.

    Returns ``cap_feats`` ``[B, L, D]`` in ``dtype`` (``L`` = longest prompt in the
    batch, zero-padded) and ``cap_lens`` ``[B]`` (int64, real tokens per prompt).
    ``cap_lens`` stays an integer tensor whatever ``dtype`` is. The prompt list is
    copied because ``ZImagePipeline._encode_prompt`` rewrites its argument in place.
    """
    with torch.no_grad():
        feats, _ = pipe.encode_prompt(
            list(prompts),
            device=device,
            do_classifier_free_guidance=False,
            max_sequence_length=_MAX_SEQUENCE_LENGTH,
        )
    lens = [int(f.shape[0]) for f in feats]
    width = max(lens)
    cap_feats = feats[0].new_zeros((len(feats), width, feats[0].shape[-1]))
    for i, f in enumerate(feats):
        cap_feats[i, : f.shape[0]] = f
    return {
        "cap_feats": cap_feats.to(device=device, dtype=dtype),
        "cap_lens": torch.tensor(lens, dtype=torch.long, device=device),
    }



def prompt_inputs(pipe: DiffusionPipeline, kwargs: dict) -> dict | None:
    """What ``ZImagePipeline``'s prompt encoding depends on in one call (for the
    inference prompt cache, :mod:`engine.runtime.prompt_cache`): the prompts,
    whether CFG runs (the pipeline's rule: ``guidance_scale`` > 0) with its
    negatives (empty ones when none is given), and the maximum length."""
    from engine.contract.family_helpers import call_value, prompt_list

    prompts = prompt_list(kwargs.get("prompt"))
    if prompts is None:
        return None
    cfg = float(call_value(pipe, kwargs, "guidance_scale") or 0.0) > 0
    return {
        "prompt": prompts,
        "negative_prompt": prompt_list(kwargs.get("negative_prompt")) if cfg else None,
        "cfg": cfg,
        "max_sequence_length": int(call_value(pipe, kwargs, "max_sequence_length") or _MAX_SEQUENCE_LENGTH),
    }


def encode_prompt_inputs(pipe: DiffusionPipeline, inputs: dict, device: torch.device) -> dict[str, list[torch.Tensor]]:
    """The per-prompt embedding lists the pipeline's call computes from ``inputs``,
    through its own ``encode_prompt`` (lists copied: it rewrites them in place)."""
    negatives = inputs["negative_prompt"]
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt(
            prompt=list(inputs["prompt"]), device=device, do_classifier_free_guidance=inputs["cfg"],
            negative_prompt=list(negatives) if negatives is not None else None,
            max_sequence_length=inputs["max_sequence_length"],
        )
    return {"prompt_embeds": list(embeds), "negative_prompt_embeds": list(negative) if inputs["cfg"] else []}


def encode_images(pipe: DiffusionPipeline, pixels: torch.Tensor) -> torch.Tensor:
    """Encode ``[B, 3, H, W]`` pixels in ``[-1, 1]`` to model-space latents ``[B, 16, H/8, W/8]``.

    Uses the posterior mean (deterministic, so latents can be cached; diffusers'
    Z-Image control/inpaint pipelines encode with ``argmax`` too), then
    ``(z - shift_factor) * scaling_factor``, the exact inverse of the pipeline's
    decode. Computed under ``torch.no_grad()``; returned in ``pixels``' dtype.
    """
    vae = pipe.vae
    with torch.no_grad():
        z = vae.encode(pixels.to(dtype=vae.dtype)).latent_dist.mode().float()
        z = (z - vae.config.shift_factor) * vae.config.scaling_factor
    return z.to(dtype=pixels.dtype)


def predict(
    pipe: DiffusionPipeline,
    denoiser: torch.nn.Module,
    noisy_latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Velocity prediction ``noise - x0`` for ``noisy_latents`` ``[B, 16, h, w]`` at sigmas ``timesteps`` ``[B]``.

    Calls ``denoiser`` (not ``pipe.transformer``: the trainer may pass a peft- or
    compile-wrapped module) the way ``ZImagePipeline``'s loop does: per-sample
    lists of ``[C, 1, h, w]`` latents and of unpadded ``[L_i, D]`` captions,
    timestep ``1 - sigma`` in float32 (the transformer multiplies by its
    ``t_scale`` of 1000, so bf16 would round it coarsely), and the output negated
    because Z-Image predicts ``x0 - noise``. The latents run in the conditioning's
    dtype (the compute dtype the trainer encoded prompts in); the result comes
    back in ``noisy_latents``' dtype, ``[B, 16, h, w]``. Gradients flow.
    """
    cap_feats = conditioning["cap_feats"]
    cap_lens = conditioning["cap_lens"].tolist()
    b = noisy_latents.shape[0]
    compute_dtype = cap_feats.dtype
    x = [lat.unsqueeze(1) for lat in noisy_latents.to(compute_dtype).unbind(0)]
    caps = [cap_feats[i, :n] for i, n in enumerate(cap_lens)]
    t = 1.0 - timesteps.to(device=noisy_latents.device, dtype=torch.float32).reshape(b)
    out = denoiser(x=x, t=t, cap_feats=caps, return_dict=False)[0]
    velocity = -torch.stack(out, dim=0).squeeze(2)
    return velocity.to(noisy_latents.dtype)


# -- the training-memory tool (engine.testing.memory_figures) ---------------------------------


def probe_conditioning(config: dict, text_tokens: int, dtype: torch.dtype) -> dict[str, object]:
    """One caption of ``text_tokens`` positions; its length is host data (``predict`` reads it
    with ``tolist``), given as a plain value so fake tensors can run the step."""
    from types import SimpleNamespace

    return {
        "cap_feats": torch.randn(1, text_tokens, config["cap_feat_dim"], dtype=dtype),
        "cap_lens": SimpleNamespace(tolist=lambda: [text_tokens]),
    }
