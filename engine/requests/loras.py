"""How a request names a LoRA: ``PATH[:SCALE]``, a ``{"path", "scale"}`` item or a pair.

Syntax and bounds only; the file itself is read from its header by
:mod:`engine.preflight.lora`, before anything is loaded or evicted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from engine.errors import PreflightError

#: Scales outside this range are almost surely a typo (``:10`` for ``:1.0``).
MAX_SCALE = 8.0


@dataclass(frozen=True)
class LoraChoice:
    """A LoRA the caller asked for: where it is and how strongly to apply it."""

    path: str
    scale: float = 1.0
    #: Apply the modules that match the model and skip the rest (counted in the plan); without
    #: it a LoRA with any module the model lacks is refused.
    partial: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.scale) or abs(self.scale) > MAX_SCALE:
            raise PreflightError(
                f"LoRA scale {self.scale} for {self.path} is outside -{MAX_SCALE}..{MAX_SCALE}; "
                "give a scale such as 0.8 (PATH:0.8)",
                code="invalid_request",
            )


def parse_lora_arg(text: str) -> LoraChoice:
    """``PATH[:SCALE]`` -> a :class:`LoraChoice` (scale 1.0 when none is given).

    The scale is the part after the last ``:`` only when it reads as a number,
    so a path that itself holds a colon still works."""
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            return LoraChoice(path, float(tail))
        except ValueError:
            pass
    return LoraChoice(text, 1.0)


#: What callers may give for a LoRA: ``"PATH[:SCALE]"``, ``{"path", "scale", "partial"}``,
#: ``(path, scale)`` or a :class:`LoraChoice`.
LoraLike = Union[str, Path, LoraChoice, Mapping[str, object], tuple[Union[str, Path], float]]


def lora_choices(items: Iterable[LoraLike]) -> tuple[LoraChoice, ...]:
    """Every way a caller may name a LoRA, as :class:`LoraChoice` values."""
    choices = []
    for item in items:
        if isinstance(item, LoraChoice):
            choices.append(item)
        elif isinstance(item, (str, Path)):
            choices.append(parse_lora_arg(str(item)))
        elif isinstance(item, Mapping) and "path" in item:
            scale = item.get("scale", 1.0)
            choices.append(LoraChoice(str(item["path"]), float(scale), bool(item.get("partial", False))))  # type: ignore[arg-type]
        elif isinstance(item, tuple) and len(item) == 2:
            choices.append(LoraChoice(str(item[0]), float(item[1])))
        else:
            raise PreflightError(
                f"cannot read {item!r} as a LoRA; give 'PATH[:SCALE]' or {{'path': ..., 'scale': ...}}",
                code="invalid_request",
            )
    return tuple(choices)


__all__ = ["MAX_SCALE", "LoraChoice", "LoraLike", "lora_choices", "parse_lora_arg"]
