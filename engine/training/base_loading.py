"""The base pipeline a training run loads, and when its denoisers come in.

A run on one denoiser loads the pipeline whole (an nf4 denoiser quantised by bitsandbytes as
it loads). A two-expert base loads without its experts: the captions and latents are cached
with the text encoder and the VAE alone on the device, and only then are the experts the run
holds loaded (those it trains; a one-expert run's other expert only for its samples).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from engine.training.preflight import TrainingPlan


def load_base(plan: TrainingPlan, dtype: torch.dtype) -> Any:
    """The base pipeline, its processors built as the inference load builds them (an edit
    model's without the video part torchvision would build: :mod:`engine.runtime.processors`)."""
    import diffusers

    from engine.preflight.pipeline_index import modular_index
    from engine.runtime.modular import open_pipeline
    from engine.runtime.processors import pipeline_processors

    if modular_index(Path(plan.base.location)) is not None:  # its blocks over a ComponentsManager
        pipe = open_pipeline(Path(plan.base.location), plan.family, dtype)
        pipe.set_progress_bar_config(disable=True)
        return pipe
    components: dict[str, Any] = dict(pipeline_processors(plan.base.location))
    if plan.expert is not None:  # loaded after the captions are cached (load_denoisers)
        pipe = _pipeline_without(plan.base.location, (plan.family.pipeline.denoiser, *plan.family.pipeline.experts),
                                 dtype, components)
    else:
        if plan.base_precision.value == "nf4":
            index = diffusers.DiffusionPipeline.load_config(plan.base.location)
            components[plan.family.pipeline.denoiser] = _denoiser(plan, plan.family.pipeline.denoiser, dtype, index)
        pipe = diffusers.DiffusionPipeline.from_pretrained(plan.base.location, dtype=dtype, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_without(location: str, left_out: tuple[str, ...], dtype: torch.dtype, given: dict[str, Any]) -> Any:
    """The pipeline with the ``left_out`` components None and the rest loaded as diffusers loads
    them, one by one from the index: its ``from_pretrained`` loads an optional component (a two-expert
    model's experts) even when it is passed None."""
    import diffusers

    index = diffusers.DiffusionPipeline.load_config(location)
    parts = dict(given)
    for name, entry in index.items():
        if name.startswith("_") or name in parts:
            continue
        if not isinstance(entry, list):  # a pipeline setting (a two-expert pipeline's boundary_ratio)
            parts[name] = entry
            continue
        library, class_name = entry
        if name in left_out or class_name is None:
            parts[name] = None
            continue
        loader = getattr(importlib.import_module(library), class_name)
        options = {"dtype": dtype} if issubclass(loader, torch.nn.Module) else {}
        parts[name] = loader.from_pretrained(location, subfolder=name, **options)
    return getattr(diffusers, index["_class_name"])(**parts)


def _denoiser(plan: TrainingPlan, name: str, dtype: torch.dtype, index: dict[str, Any]) -> torch.nn.Module:
    """The base's denoiser ``name`` (its class from the pipeline's ``index``; an nf4 one quantised
    by bitsandbytes as it loads), frozen."""
    import diffusers

    options: dict[str, Any] = {}
    if plan.base_precision.value == "nf4":
        from engine.runtime.quantize import nf4_config

        options["quantization_config"] = nf4_config(dtype)
    module: torch.nn.Module = getattr(diffusers, index[name][1]).from_pretrained(
        plan.base.location, subfolder=name, dtype=dtype, **options)
    return module.requires_grad_(False)


def load_denoisers(plan: TrainingPlan, pipe: Any, dtype: torch.dtype) -> None:
    """A two-expert base's experts, once the encoders are off the device: those trained, and a
    one-expert run's other expert only for its samples (never beside the encoders while caching)."""
    if plan.expert is None:
        return
    import diffusers

    index = diffusers.DiffusionPipeline.load_config(plan.base.location)  # once for every expert
    pipe.register_modules(**{name: _denoiser(plan, name, dtype, index) for name in plan.loaded_denoisers})


__all__ = ["load_base", "load_denoisers"]
