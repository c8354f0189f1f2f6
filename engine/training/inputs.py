"""The trainer's inputs, encoded once before the first step: a latent per
image (or clip: its window's frames, each fitted as an image is) at its bucket's size, and an embedding per distinct prompt (from the
on-disk prompt cache when this base encoded these prompts before).

The caption options are met here (the trigger word, caption dropout's empty
prompt, a few tag shuffles per caption: :mod:`engine.training.captions`),
and :func:`prompt_row` picks, as a pure draw a resumed run repeats, which
cached prompt each sample of a step trains on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from PIL import Image, ImageOps

from engine.preflight.clips import ClipWindow, read_window
from engine.training.buckets import Fit, fit
from engine.training.captions import CaptionOptions, choose, prompt_table
from engine.training.preflight import TrainingPlan


@dataclass(frozen=True)
class Captions:
    """The cached prompts' rows: each image's caption variants and the empty prompt's (caption dropout)."""

    per_image: list[list[int]]
    empty: int | None


def prompt_row(captions: Captions, options: CaptionOptions, seed: int, step: int, slot: int, image: int) -> int:
    """The cached prompt row sample ``slot`` of ``step`` trains on (a pure draw: resume repeats it)."""
    variants = captions.per_image[image]
    pick = choose(options, seed, step, slot, len(variants))
    if pick is None and captions.empty is not None:
        return captions.empty
    return variants[pick or 0]


def cache_inputs(
    plan: TrainingPlan, pipe: Any, runtime: ModuleType, device: torch.device, dtype: torch.dtype,
    between: Callable[[], None],
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], Captions]:
    """Latents per image (at its bucket's size) and prompt embeddings per distinct prompt, computed once.

    Caption options are met here: the trigger word is in every cached prompt,
    caption dropout adds the empty prompt, and tag shuffling caches a few
    shuffles per caption (:mod:`engine.training.captions`); no text encoder
    runs during training. ``between`` runs before each image (the trainer's
    stop check: a stop is honoured while caching).
    """
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name not in plan.family.denoisers:
            component.to(device)
    size = plan.config.resolution
    latents = []
    for index, item in enumerate(plan.dataset.items):
        between()
        shape = plan.buckets.fits[index] if plan.buckets else fit(item.size, (size, size))
        if item.is_clip and plan.window is not None:
            pixels = load_clip(item.image, shape, plan.window)
        else:
            pixels = load_pixels(item.image, shape)
        latents.append(runtime.encode_images(pipe, pixels.to(device, dtype))[0].to("cpu"))
    config = plan.config
    prompts, per_image, empty = prompt_table(
        [item.caption for item in plan.dataset.items], CaptionOptions.from_config(config), config.seed
    )
    conditioning = cached_prompts(plan, pipe, runtime, prompts, device, dtype)
    return latents, conditioning, Captions(per_image, empty)


def cached_prompts(
    plan: TrainingPlan, pipe: Any, runtime: ModuleType, prompts: list[str], device: torch.device, dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The prompts' embeddings, from the on-disk cache when this base encoded these
    exact prompts before (see :mod:`engine.runtime.prompt_cache`)."""
    config = plan.config

    def encode(texts: list[str]) -> dict[str, torch.Tensor]:
        return {k: v.to("cpu") for k, v in runtime.encode_prompts(pipe, texts, device, dtype).items()}

    if not config.prompt_cache:
        return encode(prompts)
    from engine.runtime.prompt_cache import PromptCache, default_dir, encoder_identity, one_row_per_prompt

    cache = PromptCache(Path(config.prompt_cache_dir) if config.prompt_cache_dir else default_dir())
    settings = {"dtype": str(dtype), "device": device.type, "encode": f"{runtime.__name__}.encode_prompts", "family": plan.family.name}
    embeddings, _ = cache.get_or_encode(encoder_identity(plan.base.location), prompts, settings, encode,
                                        fits=one_row_per_prompt(len(prompts)))
    return embeddings


def load_clip(path: Path, shape: Fit, window: ClipWindow) -> torch.Tensor:
    """The clip's window (:func:`engine.preflight.clips.read_window`: sampled at the family's fps,
    upright), each frame fitted as an image is, in [-1, 1], [1, 3, F, H, W]."""
    frames = [_fitted(frame, shape) for frame in read_window(path, window)]
    return torch.stack(frames, dim=1).unsqueeze(0)


def load_pixels(path: Path, shape: Fit) -> torch.Tensor:
    """Upright RGB resized to cover ``shape.bucket`` and centre-cropped to it, in [-1, 1], [1, 3, H, W]."""
    with Image.open(path) as image:
        rgb = ImageOps.exif_transpose(image).convert("RGB")
    return _fitted(rgb, shape).unsqueeze(0)


def _fitted(rgb: Image.Image, shape: Fit) -> torch.Tensor:
    """``rgb`` resized to cover the bucket and centre-cropped, in [-1, 1], [3, H, W]."""
    if rgb.size != shape.source:
        shape = fit(rgb.size, shape.bucket)  # the file changed since the preflight: fit what is there
    rgb = rgb.resize(shape.resized, Image.Resampling.BICUBIC).crop(shape.box)
    width, height = shape.bucket
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(height, width, 3)
    return data.permute(2, 0, 1).float() / 127.5 - 1.0
