"""Batches of images: one seed per image, chunks within the plan, halved on OOM.

Every image of a batch has its own ``torch.Generator`` seeded with its own
seed, so image *k* can be replayed alone from its seed. Images go through the
pipeline in chunks (one forward per chunk): as many as the memory plan
leaves room for on a GPU; one at a time on the CPU, where a batched forward
is no faster and its kernels are not batch-invariant (a batch of three gives
pixels off by one from three single runs), which would break the replay. A
chunk that runs out of device memory is split in half and each half retried,
down to single images; every split is recorded for ``status()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine.requests.batch import BatchItem, batch_items
from engine.runtime.quantize import first_line

__all__ = ["BatchItem", "SplitEvent", "batch_items", "chunk_size", "generators", "run_chunked"]

T = TypeVar("T")


@dataclass(frozen=True)
class SplitEvent:
    """A chunk that ran out of memory and was split in half."""

    size: int
    into: tuple[int, int]
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"event": "out_of_memory_split", "chunk": self.size, "into": list(self.into), "reason": self.reason}


def chunk_size(count: int, device: str, *, free_gb: float, per_image_gb: float, requested: int | None = None) -> int:
    """Images per forward: ``requested`` when given, else one on the CPU, else
    as many as ``free_gb`` of headroom holds at ``per_image_gb`` each."""
    if requested:
        return max(1, min(count, requested))
    if device == "cpu":
        return 1
    if per_image_gb <= 0:
        return count
    return max(1, min(count, 1 + math.floor(max(free_gb, 0.0) / per_image_gb)))


def run_chunked(
    items: Sequence[T],
    size: int,
    forward: Callable[[Sequence[T]], list[Any]],
    on_split: Callable[[SplitEvent], None],
) -> list[Any]:
    """``forward`` over ``items`` in chunks of ``size``; a chunk raising
    ``torch.OutOfMemoryError`` is split in half (recorded through ``on_split``)
    and each half retried. A single image that runs out of memory re-raises."""
    results: list[Any] = []
    pending = [list(items[i:i + size]) for i in range(0, len(items), size)]
    while pending:
        chunk = pending.pop(0)
        try:
            results.extend(forward(chunk))
        except torch.OutOfMemoryError as exc:
            if len(chunk) == 1:
                raise
            half = (len(chunk) + 1) // 2
            _free_device_memory()
            on_split(SplitEvent(len(chunk), (half, len(chunk) - half), first_line(exc)[:200]))
            pending[:0] = [chunk[:half], chunk[half:]]
    return results


def generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per image (CPU: the same noise on every device)."""
    return [torch.Generator("cpu").manual_seed(seed) for seed in seeds]


def _free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
