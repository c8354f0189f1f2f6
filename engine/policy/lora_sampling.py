"""The sampling a few-step LoRA sets: its own (its metadata) or its family table's (its name).

A step-distillation LoRA (a Lightning or lightx2v LoRA, a Turbo or DMD LoRA) was
trained for a handful of steps at guidance 1: left at the checkpoint's 40-50 steps and CFG it
renders an over-cooked image, slowly. The first LoRA that says how it samples decides the
defaults a request leaves open; an explicit ``steps`` or ``guidance`` always wins. Torch-free.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.contract.types import FamilySpec, FewStepLora


@dataclass(frozen=True)
class LoraSampling:
    """Steps and guidance a LoRA samples at, and why (for the plan)."""

    steps: int | None
    guidance: float | None
    reason: str
    #: The flow-matching timestep shift it samples at (None: the checkpoint's schedule).
    shift: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "guidance": self.guidance, "shift": self.shift, "reason": self.reason}


class _Lora(Protocol):
    @property
    def path(self) -> Path: ...

    @property
    def scale(self) -> float: ...

    @property
    def sampling(self) -> tuple[int | None, float | None, float | None] | None: ...

    @property
    def name(self) -> str: ...


def table_entry(family: FamilySpec, path: Path) -> FewStepLora | None:
    """The family's few-step LoRA ``path`` names (its file name against the table's globs)."""
    name = path.name.lower()
    return next((entry for entry in family.lora.few_step if fnmatch.fnmatch(name, entry.pattern)), None)


def sampling_of(family: FamilySpec, files: Sequence[_Lora]) -> LoraSampling | None:
    """The sampling the applied LoRAs set (a LoRA at scale 0 sets none); None: theirs is the
    checkpoint's."""
    for file in files:
        if file.scale == 0:
            continue
        if file.sampling is not None:
            steps, guidance, shift = file.sampling
            return LoraSampling(steps, guidance, f"LoRA {file.name} samples{_said(steps, guidance, shift)} (its metadata)",
                                shift)
        entry = table_entry(family, file.path)
        if entry is not None:
            said = _said(entry.steps, entry.guidance, entry.shift)
            return LoraSampling(entry.steps, entry.guidance, f"LoRA {file.name} is {entry.name}: it samples{said}",
                                entry.shift)
    return None


def _said(steps: int | None, guidance: float | None, shift: float | None = None) -> str:
    parts = ([f" {steps} steps"] if steps else []) + ([f" at guidance {guidance:g}"] if guidance is not None else []) \
        + ([f", timestep shift {shift:g}"] if shift is not None else [])
    return "".join(parts) or " as its base does"
