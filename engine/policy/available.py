"""The memory a job will have: free now, plus what eviction would release.

A request is sized against the device as it will be when the job starts,
not as it is while the engine's own pipeline and the host's residents still
sit on it: their memory is about to be freed, so counting it as used would
plan a smaller mode (or refuse) for no reason. Each figure says where it
came from, so ``plan``, ``train --dry-run`` and the HTTP routes can show it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.hardware.profile import HardwareProfile


@dataclass(frozen=True)
class Releasable:
    """Memory a resident holds that eviction gives back."""

    name: str
    gb: float
    #: "declared by the host" or "the engine's loaded pipeline (...)".
    source: str


@dataclass(frozen=True)
class AvailableMemory:
    total_gb: float
    #: None when the device cannot say (then nothing is added either).
    free_now_gb: float | None
    #: Where ``free_now_gb`` came from: a probe, a preset, an override.
    free_source: str
    releasable: tuple[Releasable, ...] = ()

    @property
    def after_eviction_gb(self) -> float | None:
        if self.free_now_gb is None:
            return None
        released = sum(r.gb for r in self.releasable)
        return max(self.free_now_gb, min(self.total_gb, self.free_now_gb + released))

    def apply(self, hardware: HardwareProfile) -> HardwareProfile:
        """``hardware`` with the free memory the job will have."""
        return hardware.replace(free_memory_gb=self.after_eviction_gb)

    def to_dict(self) -> dict[str, object]:
        after = self.after_eviction_gb
        return {
            "total_gb": round(self.total_gb, 2),
            "free_now_gb": None if self.free_now_gb is None else round(self.free_now_gb, 2),
            "free_source": self.free_source,
            "releasable": [
                {"name": r.name, "gb": round(r.gb, 2), "source": r.source} for r in self.releasable
            ],
            "after_eviction_gb": None if after is None else round(after, 2),
        }

    def summary(self) -> str:
        """One line: where the figure decisions use comes from."""
        if self.free_now_gb is None:
            return f"free memory unknown ({self.free_source}); {self.total_gb:.1f} GB total"
        parts = [f"{self.free_now_gb:.1f} GB free now ({self.free_source})"]
        parts += [f"+ {r.gb:.1f} GB {r.name} ({r.source})" for r in self.releasable]
        capped = " (capped at the device total)" if self.after_eviction_gb == self.total_gb and self.releasable else ""
        return " ".join(parts) + f" = {self.after_eviction_gb:.1f} GB after eviction{capped}"


def available_memory(hardware: HardwareProfile, releasable: Iterable[Releasable] = ()) -> AvailableMemory:
    """What a job on ``hardware`` will have once ``releasable`` is evicted."""
    return AvailableMemory(
        total_gb=hardware.total_memory_gb,
        free_now_gb=hardware.free_memory_gb,
        free_source=hardware.source,
        releasable=tuple(r for r in releasable if r.gb > 0),
    )
