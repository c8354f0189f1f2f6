"""A decision with its provenance: what was chosen, by whom, and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
Source = Literal["auto", "explicit"]


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """``value`` chosen by the engine (``auto``) or the user (``explicit``).

    ``reason`` names the rule that fired, so a UI can show "Auto: int8" with
    the reason as its tooltip, and a log says why without a debugger.
    """

    value: T
    source: Source
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"value": self.value, "source": self.source, "reason": self.reason}


def auto(value: T, reason: str) -> Resolved[T]:
    return Resolved(value, "auto", reason)


def explicit(value: T, reason: str = "requested") -> Resolved[T]:
    return Resolved(value, "explicit", reason)
