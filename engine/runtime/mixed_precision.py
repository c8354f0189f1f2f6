"""A pipeline whose components compute in different dtypes: the glue between them.

The plan may give the text encoders or the VAE a dtype of their own beside the denoiser's
(an fp16-unsafe encoder in bf16 or fp32 beside an fp16 denoiser: see
:mod:`engine.policy.component_dtypes`). A diffusers pipeline passes the encoders' outputs to
the denoiser, and the denoiser's latents to the VAE, in the dtype they come in, and not every
pipeline casts them: so each denoiser takes its floating inputs in its own dtype (a forward
pre-hook), and the VAE its encode / decode input in its own. Nothing is installed when every
component computes alike.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch

#: The plan's controls that may give a component its own dtype.
COMPONENT_CONTROLS = {"text_encoders": "text_encoder_dtype", "vae": "vae_dtype"}


def mixed(plan: Any) -> bool:
    """Whether the plan computes some component in a dtype other than the denoiser's."""
    compute = plan.value("dtype")
    return any(plan.value(control, compute) != compute for control in COMPONENT_CONTROLS.values())


def align_components(pipe: Any, denoisers: list[torch.nn.Module], plan: Any) -> list[str]:
    """Cast what flows into each denoiser and into the VAE to that module's dtype, where the
    plan mixes dtypes; the components it touched."""
    if not mixed(plan):
        return []
    touched = []
    for denoiser in denoisers:
        denoiser.register_forward_pre_hook(_cast_hook(_dtype_of(denoiser)), with_kwargs=True)
        touched.append(type(denoiser).__name__)
    vae = getattr(pipe, "vae", None)
    if isinstance(vae, torch.nn.Module):
        for name in ("encode", "decode"):
            if hasattr(vae, name):
                setattr(vae, name, _casting(getattr(vae, name), vae))
        touched.append("vae")
    return touched


def _dtype_of(module: torch.nn.Module) -> torch.dtype:
    """The dtype ``module`` computes in: a diffusers model's own answer (it passes over the
    parts the model keeps in fp32, such as a video DiT's time embedder and norms, and reads a layerwise
    cast's compute dtype), else the dtype of most of its floating weights. The first parameter's
    dtype would be that fp32 time embedder's, and the bf16 blocks would get fp32 latents."""
    declared = getattr(module, "dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    weights: collections.Counter[torch.dtype] = collections.Counter()
    for parameter in module.parameters():
        if parameter.is_floating_point():
            weights[parameter.dtype] += parameter.numel()
    return weights.most_common(1)[0][0] if weights else torch.float32


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


#: Inputs a denoiser takes in their own precision (it embeds the timestep in the fp32 parts it
#: keeps, casting as it needs): cast to bf16 they would lose what stock diffusers keeps.
_OWN_PRECISION = ("timestep", "timesteps", "guidance")


def _cast_hook(dtype: torch.dtype) -> Any:
    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(_cast(a, dtype) for a in args), {k: v if k in _OWN_PRECISION else _cast(v, dtype)
                                                       for k, v in kwargs.items()}
    return hook


def _casting(method: Any, module: torch.nn.Module) -> Any:
    """``method`` taking its input in ``module``'s dtype at call time (a pipeline may upcast its
    VAE to fp32 for the decode, as some do: the input follows)."""
    @functools.wraps(method)
    def call(sample: Any, *args: Any, **kwargs: Any) -> Any:
        return method(_cast(sample, _dtype_of(module)), *args, **kwargs)
    return call
