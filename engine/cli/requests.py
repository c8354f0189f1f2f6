"""Flags -> the engine's request models, validated before anything loads.

The CLI builds the same :class:`~engine.requests.PlanControls` and
:class:`~engine.requests.GenerateBody` the HTTP API validates; a problem is
reported naming the flag the user typed (``--width must be a multiple of
16 (got 100)``), with the API's ``invalid_request`` code.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from engine.errors import EngineError
from engine.policy.batch import BatchItem, batch_items
from engine.requests import GenerateBody, PlanControls, describe_problems

M = TypeVar("M", bound=BaseModel)

#: Request field -> the flag that sets it (the flag's argparse dest is the field's name).
PLAN_FIELDS: dict[str, str] = {
    "dtype": "--dtype", "quant": "--quant", "memory": "--memory", "attention": "--attention",
    "step_cache": "--step-cache", "compile": "--compile", "speed": "--speed", "steps": "--steps",
    "threads": "--threads", "text_encoder_quant": "--text-encoder-quant",
    "text_encoder_memory": "--text-encoder-memory", "vae_tiling": "--vae-tiling",
    "prompt_cache": "--no-prompt-cache",
}
GENERATE_FIELDS: dict[str, str] = {
    "prompt": "--prompt", "negative_prompt": "--negative-prompt", "steps": "--steps",
    "guidance": "--guidance", "width": "--width", "height": "--height", "seed": "--seed",
    "count": "--count", "loras": "--lora", "prompts": "--prompt", "seeds": "--seeds", "batch": "--batch",
    "image": "--image", "mask_image": "--mask", "strength": "--strength", "control_image": "--control-image",
    "control_preprocess": "--control-preprocess", "control_scale": "--control-scale",
}
#: Plan control (as the plan names it) -> the flag that asks for it.
CONTROL_FLAGS: dict[str, str] = {
    "dtype": "--dtype", "transformer_quant": "--quant", "memory_mode": "--memory",
    "attention_backend": "--attention", "step_cache": "--step-cache", "compile": "--compile",
    "speed_tier": "--speed", "threads": "--threads", "text_encoder_quant": "--text-encoder-quant",
    "text_encoder_memory": "--text-encoder-memory", "vae_tiling": "--vae-tiling",
    "prompt_cache": "--no-prompt-cache",
}
#: What ``--tiny`` means when a size or step count is not given: small and quick for every family.
TINY_DEFAULTS: dict[str, int] = {"width": 64, "height": 64, "steps": 4}
#: Image formats that carry the prompt and seed in text chunks.
IMAGE_SUFFIXES = (".png",)


class InvalidFlags(EngineError):
    """Flags the request model refuses; the message names each flag."""

    code = "invalid_request"


def validated(model: type[M], data: Mapping[str, object], flags: Mapping[str, str]) -> M:
    """``model`` built from ``data``, or :class:`InvalidFlags` naming the flags at fault."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        def name_of(loc: tuple[int | str, ...]) -> str:
            return flags.get(str(loc[0]), str(loc[0])) if loc else "the request"

        raise InvalidFlags("; ".join(describe_problems(exc, name_of))) from None


def plan_controls(args: argparse.Namespace) -> PlanControls:
    return validated(PlanControls, {f: getattr(args, f, None) for f in PLAN_FIELDS
                                    if getattr(args, f, None) is not None}, PLAN_FIELDS)


def generate_body(args: argparse.Namespace, seed: int) -> GenerateBody:
    """The generate request the flags describe (``--tiny`` fills sizes and steps left out)."""
    # A field's flag stores under the field's name (argparse dest): a new
    # GenerateBody field is a GENERATE_FIELDS row and an add_argument.
    data: dict[str, object] = {field: getattr(args, field, None) for field in GENERATE_FIELDS
                               if field not in ("loras", "prompt", "prompts")}
    prompts = list(args.prompt_list)
    data["prompt"] = prompts[0]
    if len(prompts) > 1:
        data["prompts"] = prompts
    data["seed"] = seed
    if getattr(args, "tiny", None):
        data.update({k: v for k, v in TINY_DEFAULTS.items() if data.get(k) is None})
    if args.lora:
        from engine.preflight.lora import lora_choices

        data["loras"] = [{"path": c.path, "scale": c.scale} for c in lora_choices(args.lora)]
    return validated(GenerateBody, {k: v for k, v in data.items() if v is not None}, GENERATE_FIELDS)


def images_of(body: GenerateBody) -> list[BatchItem]:
    """The images the request makes, each with its own prompt and seed (what the engine runs)."""
    return batch_items(body.prompt, prompts=body.prompts or (), seeds=body.seeds or (), seed=body.seed,
                       count=body.count, negative_prompt=body.negative_prompt)


def output_paths(output: str, count: int, *, overwrite: bool) -> list[Path]:
    """The files a generate writes, refused now (before loading) if they cannot be written."""
    path = Path(output)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise InvalidFlags(
            f"-o/--output {output}: give a file name ending in .png (the image keeps its prompt, "
            "seed and model in PNG text chunks), e.g. -o out.png"
        )
    if path.is_dir():
        raise InvalidFlags(f"-o/--output {output} is a folder; give a file name ending in .png")
    paths = [path] if count == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise EngineError(
            f"{', '.join(existing)} already exists; choose another -o/--output or pass --overwrite",
            code="output_exists",
        )
    return paths
