"""What a request may call a model by, and what the model takes of its input images.

A request (images, edits, videos; OpenAI's or the engine's) may name a model in its
``model`` field, as the OpenAI API has it (the generate's checks,
:mod:`engine.service.generating`, judge it). A request naming no model is for the
loaded one. A name the loaded model answers to (its folder, checkpoint, repo or family)
and OpenAI's own model names (:data:`OPENAI_NAMES`: ``dall-e-3``, ``gpt-image-1``,
``sora-2``...) mean the loaded model, so a client hard-wired to them keeps working.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.errors import EngineError
from engine.service.tickets import Target, model_name

if TYPE_CHECKING:
    from engine.contract.types import Checkpoint, FamilySpec
    from engine.preflight.source import ModelSource

__all__ = ["OPENAI_NAMES", "Target", "answers_to", "check_references", "means_loaded", "model_name"]

#: OpenAI's own model names: they mean whatever model is loaded here.
OPENAI_NAMES = re.compile(r"(dall-e-[23]|gpt-image-[\w.-]+|sora-[\w.-]+)", re.IGNORECASE)


def answers_to(source: ModelSource) -> set[str]:
    """Every name a request may call a loaded model by."""
    family, checkpoint = source.family, source.checkpoint or source.family.default_checkpoint
    names = {source.location, model_name(source), family.name, *family.aliases}
    if checkpoint is not None:
        names |= {checkpoint.name, checkpoint.repo}
    return {name.lower() for name in names if name}


def means_loaded(loaded: Target | None, name: str | None) -> bool:
    """Whether ``name`` (a request's ``model``) means the ``loaded`` model: none given, one of its
    names, or OpenAI's own; with nothing loaded only an absent name does (it is then refused)."""
    if name is None:
        return True
    if OPENAI_NAMES.fullmatch(name.strip()):
        return True
    if loaded is None:
        return False
    return name.strip().lower() in answers_to(loaded.ticket.source) or (
        os.path.exists(name) and os.path.realpath(name) == os.path.realpath(loaded.key))


def check_references(family: FamilySpec, checkpoint: Checkpoint | None,
                     sizes: Sequence[tuple[str, tuple[int, int]]]) -> None:
    """Several input images (``sizes``: the request's ``image`` or ``image[i]``, as their headers
    declare them) go only to a checkpoint whose edit takes them (its table's ``reference_images``),
    and each is as large as its processor takes (``min_image_side``), refused before anything
    loads, naming the ones that do."""
    images = [(field, size) for field, size in sizes if field == "image" or field.startswith("image[")]
    count = len(images) if any(field.startswith("image[") for field, _ in images) else 0
    chosen = checkpoint or family.default_checkpoint
    _check_sides(chosen, images)
    if count <= 1 or count <= chosen.reference_images:
        return
    takers = [f"{c.name} (up to {c.reference_images})" for c in family.checkpoints if c.reference_images > 1]
    where = f"; {family.label}'s that do: {', '.join(takers)}" if takers else ""
    raise EngineError(f"{count} input images were given, but {chosen.label} edits "
                      f"{'one image' if chosen.reference_images == 1 else f'at most {chosen.reference_images}'} at a "
                      f"time{where}; give one image, or load a checkpoint that takes several", code="too_many_images")


def _check_sides(checkpoint: Checkpoint, sizes: Sequence[tuple[str, tuple[int, int]]]) -> None:
    """Each input image at least the checkpoint's ``min_image_side``."""
    from engine.preflight.images import InvalidImage

    if not checkpoint.min_image_side:
        return
    for field, size in sizes:
        if min(size) < checkpoint.min_image_side:
            raise InvalidImage(f"{field} is {size[0]}x{size[1]}; {checkpoint.label} takes input images of at least "
                               f"{checkpoint.min_image_side} pixels a side: give a larger image")
