"""The model a generate runs on: the loaded one, or the one its request names.

A request (images, edits, videos; OpenAI's or the engine's) may name a model in its
``model`` field, as the OpenAI API has it. :func:`target` judges the request against
that model before anything is evicted: every check a load makes
(:meth:`~engine.service.images.Images.check_load`: the model resolved, diffusers'
refusal, the plan on this machine), then the request's own door (images or frames),
and its LoRAs against the model's modules. It answers a :class:`Target`: the ticket
that loads the model. :func:`ensure` loads it at the job's turn when another model is
in by then.

A request naming no model is for the loaded one and keeps the ticket that loaded it,
so it still runs on that model after another job's model came in, or after an idle
unload. A name the loaded model answers to (its folder, checkpoint, repo or family)
and OpenAI's own model names (:data:`OPENAI_NAMES`: ``dall-e-3``, ``gpt-image-1``,
``sora-2``...) mean the loaded model, so a client hard-wired to them keeps working.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError
from engine.policy.video import check_output
from engine.requests.inference import InferenceRequest
from engine.service.tickets import LoadTicket

from engine.contract.types import Checkpoint, FamilySpec

if TYPE_CHECKING:
    from engine.preflight.source import ModelSource
    from engine.service.images import Images

#: OpenAI's own model names: they mean whatever model is loaded here.
OPENAI_NAMES = re.compile(r"(dall-e-[23]|gpt-image-[\w.-]+|sora-[\w.-]+)", re.IGNORECASE)


@dataclass(frozen=True)
class Target:
    """A model a job runs on, and the ticket that loads it."""

    ticket: LoadTicket

    @property
    def key(self) -> str:
        """Which model: its location (the same folder loaded twice is one model)."""
        return self.ticket.source.location

    @property
    def name(self) -> str:
        """What a job or a listing calls it: the folder's or file's name, else the checkpoint's."""
        return model_name(self.ticket.source)

    @property
    def family(self) -> FamilySpec:
        return self.ticket.source.family

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self.ticket.source.checkpoint


def model_name(source: ModelSource) -> str:
    """A model's short name: its folder or file name, or (a hub id) the id itself."""
    location = source.location.rstrip(os.sep)
    return os.path.basename(location) if os.path.exists(location) else location


def answers_to(source: ModelSource) -> set[str]:
    """Every name a request may call a loaded model by."""
    family, checkpoint = source.family, source.checkpoint or source.family.default_checkpoint
    names = {source.location, model_name(source), family.name, *family.aliases}
    if checkpoint is not None:
        names |= {checkpoint.name, checkpoint.repo}
    return {name.lower() for name in names if name}


def means_loaded(images: Images, name: str | None) -> bool:
    """Whether ``name`` (a request's ``model``) means the loaded model: none given, one of its
    names, or OpenAI's own; with nothing loaded only an absent name does (it is then refused)."""
    if name is None:
        return True
    loaded = images.loaded_target()
    if OPENAI_NAMES.fullmatch(name.strip()):
        return True
    if loaded is None:
        return False
    return name.strip().lower() in answers_to(loaded.ticket.source) or (
        os.path.exists(name) and os.path.realpath(name) == os.path.realpath(loaded.key))


def target(images: Images, model: str | None, body: Any, output: str = "images", *,
           uploads: bytes | list[bytes] | None = None) -> Target:
    """The model ``body`` runs on (``model``: a reference the caller has confined, or None
    for the loaded one), judged against it before anything is evicted: the load's checks,
    the door (``output``: images or frames), and the request's LoRAs."""
    loaded = images.loaded_target()
    if model is None or means_loaded(images, model):
        if loaded is None:
            raise EngineError("no model is loaded; name one in the request's model field, or load one "
                              "first (POST /v1/images/load)", code="not_loaded")
        chosen = loaded
    else:
        count = len(body.images()) if hasattr(body, "images") else 1
        sizes = InferenceRequest(width=body.width, height=body.height, count=count)
        ticket = images.check_load(model, request=sizes)
        chosen = loaded if loaded is not None and loaded.key == ticket.source.location else Target(ticket)
    check_output(chosen.family, output)
    if output == "images" and (getattr(body, "frames", None) or getattr(body, "fps", None)):
        check_output(chosen.family, "frames")  # frames asked of the images door: an image model refuses them
    check_references(chosen.family, chosen.checkpoint, uploads if uploads is not None else getattr(body, "image", None))
    if getattr(body, "loras", None) and chosen is not loaded:
        _check_loras(images, chosen, body.loras)
    return chosen


def check_references(family: FamilySpec, checkpoint: Checkpoint | None, value: Any) -> None:
    """Several input images (``value``: the request's image or images, as paths, bytes uploaded
    beside it, or pictures) go only to a checkpoint whose edit takes them (its table's
    ``reference_images``), and each is as large as its processor takes (``min_image_side``,
    from the image's header), refused before anything loads, naming the ones that do."""
    count = len(value) if isinstance(value, (list, tuple)) else 0
    chosen = checkpoint or family.default_checkpoint
    _check_sides(chosen, value)
    if count <= 1 or count <= chosen.reference_images:
        return
    takers = [f"{c.name} (up to {c.reference_images})" for c in family.checkpoints if c.reference_images > 1]
    where = f"; {family.label}'s that do: {', '.join(takers)}" if takers else ""
    raise EngineError(f"{count} input images were given, but {chosen.label} edits "
                      f"{'one image' if chosen.reference_images == 1 else f'at most {chosen.reference_images}'} at a "
                      f"time{where}; give one image, or load a checkpoint that takes several", code="too_many_images")


def _check_sides(checkpoint: Checkpoint, value: Any) -> None:
    """Each input image (a path, bytes or a picture) at least the checkpoint's ``min_image_side``."""
    from engine.preflight.images import InvalidImage, image_size, named_images

    if not checkpoint.min_image_side:
        return
    for field, item in named_images(value, "image"):
        size = item.size if hasattr(item, "getbands") else image_size(item, field)
        if min(size) < checkpoint.min_image_side:
            raise InvalidImage(f"{field} is {size[0]}x{size[1]}; {checkpoint.label} takes input images of at least "
                               f"{checkpoint.min_image_side} pixels a side: give a larger image")


def ensure(images: Images, chosen: Target) -> bool:
    """Load ``chosen`` unless it is the loaded model (its ticket re-checked where something
    changed since, as every ticket is); True when it loaded."""
    loaded = images.loaded_target()
    if loaded is not None and loaded.key == chosen.key:
        return False
    images.load(chosen.ticket)
    return True


def _check_loras(images: Images, chosen: Target, loras: Any) -> None:
    """The request's LoRAs against the model it names, before that model evicts another."""
    from engine.preflight.lora import read_loras
    from engine.requests.loras import lora_choices
    from engine.runtime.lora_check import check_loras

    files = read_loras(lora_choices([{"path": lo.path, "scale": lo.scale} for lo in loras]))
    check_loras(images.registry, chosen.ticket.source, tuple(files))
