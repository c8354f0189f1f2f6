"""A constant flow-matching timestep shift for one call: what a few-step LoRA was distilled at.

A step-distillation LoRA was trained with the scheduler shifting its timesteps by a fixed
amount (``shift`` 3 or 5, say): the checkpoint's own schedule (a shift that follows the image's
resolution, or a video model's ``flow_shift``) spends its four steps elsewhere.
For the call, the pipeline's scheduler is swapped for a copy of the same class whose config
holds that shift (``flow_shift`` where the scheduler has one, else ``shift`` with dynamic
shifting off), and put back after, whatever happens. A scheduler with neither keeps its schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def shifted(pipe: Any, shift: float | None) -> Iterator[bool]:
    """``pipe`` with its scheduler shifting timesteps by ``shift`` inside the block (True where it
    took it; False: no shift asked, or its scheduler has no shift to set)."""
    scheduler: Any = getattr(pipe, "scheduler", None)
    config = getattr(scheduler, "config", None)
    if shift is None or config is None:
        yield False
        return
    if "flow_shift" in config:
        changes: dict[str, object] = {"flow_shift": shift}
    elif "shift" in config:
        changes = {"shift": shift, "use_dynamic_shifting": False}
    else:
        yield False
        return
    pipe.scheduler = type(scheduler).from_config(config, **changes)
    try:
        yield True
    finally:
        pipe.scheduler = scheduler
