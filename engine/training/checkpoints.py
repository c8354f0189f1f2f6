"""Periodic checkpoints: everything a run needs to continue exactly where it was.

A checkpoint is a folder ``checkpoints/step-00000500/`` in the run folder
holding the LoRA (diffusers format, loadable on its own) and the training
state (:mod:`engine.training.state_file`: safetensors and JSON, never a
pickle): the trainable weights, optimizer, LR scheduler, both RNG states, the batch
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

from engine.training.state_file import CheckpointUnreadable, check_state, has_state, read_state, write_state

CHECKPOINTS = "checkpoints"
PREFIX = "step-"


def checkpoint_dirs(folder: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = Path(folder) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_checkpoint_name(p.name) and has_state(p)]
    return sorted(found, key=checkpoint_step)


def is_checkpoint_name(name: str) -> bool:
    """``step-00000500``: the names this module writes (a planted ``step-x`` is no checkpoint)."""
    return name.startswith(PREFIX) and name[len(PREFIX):].isdigit() and name[len(PREFIX):].isascii()


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
    root = Path(folder) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    temp = root / f".{final.name}.{os.getpid()}.tmp"
    remove_partial(folder)
    temp.mkdir()
    try:
        write_lora(temp)
        write_state(temp, {**state, "step": step})
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
    """The state written by :func:`save_checkpoint`, read without executing anything.

    :raises CheckpointUnreadable: the state is missing, malformed or refused.
    """
    return read_state(Path(path))


def check_checkpoint(path: Path, rank: int | None = None) -> Path:
    """``path`` as a checkpoint a run can resume from: named ``step-N``, its state readable.

    Torch-free for the engine's own format (headers only), so a resume is
    refused before anything is evicted.

    :raises CheckpointUnreadable: naming the folder and what is wrong.
    """
    path = Path(path)
    if not path.is_dir() or not is_checkpoint_name(path.name):
        raise CheckpointUnreadable(
            f"{path} is not a checkpoint folder ({CHECKPOINTS}/{PREFIX}N of a run); "
            "resume a run by its id (train --resume RUN) to continue from its newest checkpoint"
        )
    check_state(path, rank)
    return path
