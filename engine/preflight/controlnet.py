"""A ControlNet beside a pipeline, checked and sized before anything loads.

Reads the folder's ``config.json`` and safetensors headers only (no weight),
so :meth:`engine.Engine.images.plan` can size it into the plan and
:meth:`engine.Engine.images.load` can refuse a wrong one with every resident in place.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine import stored
from engine.errors import UnsupportedWorkflow
from engine.policy.quant_filter import dense_gb
from engine.preflight.headers import tensor_shapes
from engine.contract.types import FamilySpec

__all__ = ["check_controlnet", "controlnet_gb", "with_controlnet"]


def check_controlnet(family: FamilySpec, path: str) -> str:
    """``path`` resolved, when it is a diffusers ControlNet folder of a class
    ``family`` declares; refused (before anything is evicted) otherwise."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise UnsupportedWorkflow(f"controlnet {path} is not a diffusers model folder (no config.json); "
                                  "give the folder saved with save_pretrained")
    try:
        class_name = stored.read_json(config).get("_class_name")
    except (OSError, ValueError) as exc:
        raise UnsupportedWorkflow(f"controlnet {config} cannot be read ({exc})") from exc
    if class_name not in family.pipeline.controlnet_classes:
        declared = ", ".join(family.pipeline.controlnet_classes) or "none"
        raise UnsupportedWorkflow(
            f"controlnet {path} is a {class_name}; {family.label} takes {declared}; give a ControlNet for this family"
        )
    return str(folder.resolve())


def controlnet_gb(path: str) -> float:
    """bf16 GB of the ControlNet folder at ``path`` (checked by
    :func:`check_controlnet`), for the memory plan: from its safetensors
    headers (no weight is read), else the stored size of its weight files."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return dense_gb(tensor_shapes(files))
    stored = [f for pattern in ("*.bin", "*.pt", "*.pth") for f in folder.glob(pattern)]
    if not stored:
        raise UnsupportedWorkflow(f"controlnet {path} holds no weights (.safetensors or .bin); "
                                  "give the folder saved with save_pretrained")
    return sum(f.stat().st_size for f in stored) / 1e9


def with_controlnet(facts: Any, path: str | None) -> Any:
    """``facts`` (:class:`~engine.policy.plan.ModelFacts`) with the ControlNet
    at ``path`` sized in, so the plan holds it like any component."""
    return facts if path is None else dataclasses.replace(facts, controlnet_gb=controlnet_gb(path))
