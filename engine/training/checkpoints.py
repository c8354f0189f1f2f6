"""Periodic checkpoints: everything a run needs to continue exactly where it was.

A checkpoint is a folder ``checkpoints/step-00000500/`` in the run folder
holding the LoRA (diffusers format, loadable on its own) and ``state.pt``:
the trainable weights, optimizer, LR scheduler, both RNG states, the batch
order still to come, the LoRA EMA's shadow weights (so a resumed run
continues the average instead of restarting it) and the step. It is written into a hidden temporary
folder and renamed into place, so a crash mid-write leaves the previous
checkpoints intact and never a half one under a real name. Only the newest
``keep`` are kept.

Torch is imported inside the functions: the parent (CLI, server) reads
checkpoint names without it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
STATE = "state.pt"
PREFIX = "step-"


def checkpoint_dirs(folder: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = Path(folder) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / STATE).is_file()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder was written at (from its name)."""
    return int(Path(path).name[len(PREFIX):])


def latest_checkpoint(folder: Path) -> Path | None:
    found = checkpoint_dirs(folder)
    return found[-1] if found else None


def remove_partial(folder: Path) -> None:
    """Delete half-written checkpoints (a trainer killed mid-write leaves its temp folder)."""
    for temp in (Path(folder) / CHECKPOINTS).glob(f".{PREFIX}*.tmp"):
        shutil.rmtree(temp, ignore_errors=True)


def save_checkpoint(
    folder: Path, step: int, state: dict[str, Any], write_lora: Callable[[Path], object], keep: int
) -> Path:
    """Write one checkpoint atomically (temp folder + rename); prune to the newest ``keep``."""
    import torch

    root = Path(folder) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    temp = root / f".{final.name}.{os.getpid()}.tmp"
    remove_partial(folder)
    temp.mkdir()
    try:
        write_lora(temp)
        with open(temp / STATE, "wb") as out:
            torch.save({**state, "step": step}, out)
            out.flush()
            os.fsync(out.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    for old in checkpoint_dirs(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The state written by :func:`save_checkpoint` (our own file: full unpickling is fine)."""
    import torch

    with open(Path(path) / STATE, "rb") as source:
        return torch.load(source, map_location="cpu", weights_only=False)
