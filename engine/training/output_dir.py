"""The run folder a training start asks for (and ``quantize``'s output), checked before anything is freed.

An ``output_dir`` that holds anything is refused (a run never overwrites another's
record or LoRA), and so is one that cannot be written (found at the dry run, not at
the first save).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from engine.errors import PreflightError
from engine.requests.training import TrainingConfig


def output_check(config: TrainingConfig) -> None:
    """Refuse an ``output_dir`` that holds anything (a run never overwrites another's record or
    LoRA), or that cannot be written (``/proc/1/nope``: found at the dry run, not at the first save)."""
    if config.output_dir is not None:
        check_new_folder(config.output_dir)


def check_new_folder(folder: Path, field: str = "output_dir", job: str = "training") -> None:
    """``folder`` is new or empty, and can be written (``field``: how the caller names it;
    ``job``: what would overwrite it). Shared by the trainer's run folder and ``quantize``'s output."""
    if folder.exists() or folder.is_symlink():
        _check_empty_folder(folder, field, job)
    _check_writable(folder, field)


def _check_empty_folder(folder: Path, field: str, job: str) -> None:
    """A folder that exists must be an empty folder."""
    if not folder.is_dir():
        raise PreflightError(
            f"{field} {folder} is a file, not a folder; give a new folder",
            code="output_exists",
        )
    try:
        empty = next(folder.iterdir(), None) is None
    except OSError as exc:
        raise PreflightError(
            f"{field} {folder} cannot be read ({exc.strerror}); give a folder you can write",
            code="output_exists",
        ) from None
    if not empty:
        what = "an earlier run (run.json)" if (folder / "run.json").exists() else "files"
        raise PreflightError(
            f"{field} {folder} already holds {what}; {job} there would overwrite them. "
            "Give a new (or empty) folder, or move that one away",
            code="output_exists",
        )


def _check_writable(folder: Path, field: str) -> None:
    """Make (and remove) an empty folder where ``folder`` is or would be made: permission bits
    do not say it (root passes every ``access`` check, and ``/proc`` refuses even root)."""
    place = folder
    while not os.path.lexists(place) and place != place.parent:
        place = place.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".diffusion-engine-probe-", dir=place))
    except OSError as exc:
        raise PreflightError(
            f"{field} {folder} cannot be written: making a folder in {place} failed "
            f"({exc.strerror or type(exc).__name__}); give a folder you can write",
            code="output_not_writable",
        ) from None
