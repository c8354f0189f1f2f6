"""Which images a generate request makes: one (prompt, seed) per image.

Pure and torch-free, so the CLI can count and name a request's images
(output files, PNG metadata) before anything loads, and the runtime makes
exactly those images, each replayable alone from its seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import EngineError


@dataclass(frozen=True)
class BatchItem:
    """One image of a batch: its prompt, negative prompt and seed."""

    prompt: str
    seed: int
    negative_prompt: str | None = None


def batch_items(
    prompt: str,
    *,
    prompts: Sequence[str] = (),
    seeds: Sequence[int] = (),
    seed: int = 0,
    count: int = 1,
    negative_prompt: str | None = None,
) -> list[BatchItem]:
    """The images a request asks for, in order.

    ``prompts`` and ``seeds`` are lists of one entry per image (one list of
    length one is repeated to the other's length); without lists, ``count``
    images of ``prompt`` with seeds ``seed, seed + 1, ...``.
    """
    texts = list(prompts) or [prompt]
    numbers = list(seeds)
    if not numbers:
        numbers = [seed + k for k in range(count if len(texts) == 1 else len(texts))]
    if len(texts) != len(numbers) and 1 not in (len(texts), len(numbers)):
        raise EngineError(
            f"{len(texts)} prompts and {len(numbers)} seeds: give one seed per prompt, or one of either",
            code="invalid_request",
        )
    size = max(len(texts), len(numbers))
    texts, numbers = texts * (size // len(texts)), numbers * (size // len(numbers))
    return [BatchItem(text, number, negative_prompt) for text, number in zip(texts, numbers, strict=True)]
