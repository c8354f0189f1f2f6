"""Caption options: a trigger word, caption dropout, and shuffled comma-separated tags.

Pure (no torch). The trainer encodes captions once, before training, so the
options are met with cached *variants*, never a text encoder kept on the
device during training (the memory estimate assumes the encoders are gone):

* ``trigger_word`` is a prefix (``"ohwx, a red circle"``), applied once.
* ``caption_dropout`` adds one cached variant, the empty prompt; each
  sample is dropped with that probability.
* ``shuffle_tags`` caches :data:`SHUFFLE_VARIANTS` shuffles of each
  caption's tags (fewer when the tags have fewer orders; the first
  ``keep_tags`` stay in place, the trigger word always leads); each sample
  draws one. Per-step encoding would give every view its own order, but
  would keep the text encoders on the device for the whole run; eight orders
  already stop a LoRA from learning tag positions.

The variants depend on the seed and the captions only (not on the step
count: a run resumed with more steps caches what the first part did), and
every draw is a function of (seed, step, slot) alone, not of a running
random state, so a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

#: Shuffled variants cached per caption at most (each a full prompt embedding on the host).
SHUFFLE_VARIANTS = 8


@dataclass(frozen=True)
class CaptionOptions:
    trigger_word: str | None = None
    dropout: float = 0.0
    shuffle_tags: bool = False
    keep_tags: int = 0

    @classmethod
    def from_config(cls, config: object) -> CaptionOptions:
        return cls(
            trigger_word=getattr(config, "trigger_word", None) or None,
            dropout=float(getattr(config, "caption_dropout", 0.0) or 0.0),
            shuffle_tags=bool(getattr(config, "shuffle_tags", False)),
            keep_tags=int(getattr(config, "keep_tags", 0) or 0),
        )


def tags(caption: str) -> list[str]:
    """The comma-separated tags of ``caption``, stripped, empties dropped."""
    return [t.strip() for t in caption.split(",") if t.strip()]


def with_trigger(caption: str, trigger: str | None) -> str:
    """``caption`` led by ``trigger`` (once: a caption that already starts with it is kept)."""
    if not trigger:
        return caption
    if not caption:
        return trigger
    if caption == trigger or caption.startswith(trigger + ",") or caption.startswith(trigger + " "):
        return caption
    return f"{trigger}, {caption}"


def shuffled(caption: str, keep: int, rng: random.Random) -> str:
    """The tags of ``caption`` with all but the first ``keep`` in a random order."""
    parts = tags(caption)
    fixed, rest = parts[:keep], parts[keep:]
    rng.shuffle(rest)
    return ", ".join(fixed + rest)


def variant_count(caption: str, options: CaptionOptions) -> int:
    """Shuffles cached for ``caption``: :data:`SHUFFLE_VARIANTS`, or its tags' orders if fewer."""
    if not options.shuffle_tags:
        return 1
    movable = max(0, len(tags(caption)) - options.keep_tags)
    return max(1, min(SHUFFLE_VARIANTS, math.factorial(min(movable, 10))))


def variants(caption: str, options: CaptionOptions, seed: int, image: int) -> list[str]:
    """The prompts cached for image number ``image``: the caption itself, or its shuffles."""
    if not options.shuffle_tags:
        return [with_trigger(caption, options.trigger_word)]
    count = variant_count(caption, options)
    rng = random.Random(f"{seed}/shuffle/{image}")
    found: list[str] = []
    for _ in range(100 * count):  # distinct orders: count never exceeds how many there are
        order = shuffled(caption, options.keep_tags, rng)
        if order not in found:
            found.append(order)
            if len(found) == count:
                break
    return [with_trigger(order, options.trigger_word) for order in found]


def choose(options: CaptionOptions, seed: int, step: int, slot: int, count: int) -> int | None:
    """Which of ``count`` cached variants sample ``slot`` of ``step`` trains on; None: dropped (empty prompt)."""
    rng = random.Random(f"{seed}/caption/{step}/{slot}")
    if options.dropout > 0 and rng.random() < options.dropout:
        return None
    return rng.randrange(count) if count > 1 else 0


def prompt_table(
    captions: Sequence[str], options: CaptionOptions, seed: int
) -> tuple[list[str], list[list[int]], int | None]:
    """Distinct prompts to encode, each image's variant indices into them, and the empty prompt's index.

    The empty prompt is added only with caption dropout; an image whose
    caption is already empty shares its entry.
    """
    prompts: list[str] = []
    where: dict[str, int] = {}

    def index(text: str) -> int:
        if text not in where:
            where[text] = len(prompts)
            prompts.append(text)
        return where[text]

    per_image = [[index(text) for text in variants(c, options, seed, i)] for i, c in enumerate(captions)]
    empty = index("") if options.dropout > 0 else None
    return prompts, per_image, empty
