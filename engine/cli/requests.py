"""Flags -> the engine's request records, validated before anything loads.

The CLI builds the same :class:`~engine.requests.PlanControls` and
:class:`~engine.requests.GenerateBody` the HTTP API validates; a flag's
argparse destination is its request field (the control table,
:mod:`engine.requests.controls`), and a problem is reported naming the flag
the user typed (``--width must be a multiple of 16 (got 100)``), with the
API's ``invalid_request`` code.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from engine.errors import EngineError
from engine.requests.choices import TINY_DEFAULTS
from engine.requests import (
    FIELD_FLAGS,
    GENERATE_CONTROLS,
    PLAN_CONTROLS,
    PlanBody,
    PLAN_KEY_FLAGS,
    GenerateBody,
    PlanControls,
    describe_problems,
    lora_bodies,
)

M = TypeVar("M", bound=BaseModel)

#: Plan control (as the plan names it) -> the flag that asks for it.
CONTROL_FLAGS = PLAN_KEY_FLAGS
#: Image formats that carry the prompt and seed in text chunks.
IMAGE_SUFFIXES = (".png",)
#: A video model's clip (H.264); its recipe is written beside it as JSON.
VIDEO_SUFFIXES = (".mp4",)


class InvalidFlags(EngineError):
    """Flags the request model refuses; the message names each flag."""

    code = "invalid_request"


def validated(model: type[M], data: Mapping[str, object], flags: Mapping[str, str] = FIELD_FLAGS) -> M:
    """``model`` built from ``data``, or :class:`InvalidFlags` naming the flags at fault."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        def name_of(loc: tuple[int | str, ...]) -> str:
            return flags.get(str(loc[0]), str(loc[0])) if loc else "the request"

        raise InvalidFlags("; ".join(describe_problems(exc, name_of))) from None


def plan_controls(args: argparse.Namespace) -> Any:
    """The :class:`~engine.requests.PlanControls` the flags ask for."""
    return validated(PlanControls, _given(args, [c.field for c in PLAN_CONTROLS]))


def _given(args: argparse.Namespace, fields: list[str]) -> dict[str, object]:
    """The flags of ``fields`` the user gave (an absent one leaves the request's default)."""
    return {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}


def plan_body(args: argparse.Namespace) -> Any:
    """``plan``'s request: its controls and the shape it plans for (``--width --height --count
    --frames``), validated as ``POST /v1/images/plan`` validates its body."""
    return validated(PlanBody, _given(args, [*(c.field for c in PLAN_CONTROLS), "width", "height", "count", "frames"]))


def generate_body(args: argparse.Namespace, seed: int) -> GenerateBody:
    """The generate request the flags describe (``--tiny`` fills sizes and steps left out)."""
    data: dict[str, object] = {c.field: getattr(args, c.field, None) for c in GENERATE_CONTROLS}
    data["steps"] = args.steps
    images = data.get("image")
    if isinstance(images, list):  # --image is repeatable: one is a path, several a multi-image edit
        data["image"] = images[0] if len(images) == 1 else images
    prompts = list(args.prompt_list)
    data["prompt"] = prompts[0]
    if len(prompts) > 1:
        data["prompts"] = prompts
    data["seed"] = seed
    data["seeds"] = args.seeds
    if getattr(args, "tiny", None):
        data.update({k: v for k, v in TINY_DEFAULTS.items() if data.get(k) is None})
    if args.lora:
        data["loras"] = lora_bodies(args.lora, partial=getattr(args, "lora_partial", False))
    return validated(GenerateBody, {k: v for k, v in data.items() if v is not None})


def output_paths(output: str, count: int, *, overwrite: bool) -> list[Path]:
    """The files a generate writes, refused now (before loading) if they cannot be written."""
    path = Path(output)
    if path.suffix.lower() not in (*IMAGE_SUFFIXES, *VIDEO_SUFFIXES):
        raise InvalidFlags(
            f"-o/--output {output}: give a file name ending in .png (the image keeps its prompt, "
            "seed and model in PNG text chunks), e.g. -o out.png, or .mp4 for a video model (-o clip.mp4)"
        )
    if path.is_dir():
        raise InvalidFlags(f"-o/--output {output} is a folder; give a file name ending in .png or .mp4")
    paths = [path] if count == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]
    if path.suffix.lower() in VIDEO_SUFFIXES:
        paths = [path, path.with_suffix(".json")]  # the clip and its recipe
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise EngineError(
            f"{', '.join(existing)} already exists; choose another -o/--output or pass --overwrite",
            code="output_exists",
        )
    return paths
