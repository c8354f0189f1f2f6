"""The run folder a training start asks for, checked before anything is freed.

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
    folder = config.output_dir
    if folder is None:
        return
    if folder.exists() or folder.is_symlink():
        _check_empty_folder(folder)
    _check_writable(folder)


def _check_empty_folder(folder: Path) -> None:
    """An ``output_dir`` that exists must be an empty folder."""
    if not folder.is_dir():
        raise PreflightError(
            f"output_dir {folder} is a file, not a folder; give a new folder for the run",
            code="output_exists",
        )
    try:
        empty = next(folder.iterdir(), None) is None
    except OSError as exc:
        raise PreflightError(
            f"output_dir {folder} cannot be read ({exc.strerror}); give a folder you can write",
            code="output_exists",
        ) from None
    if not empty:
        what = "an earlier run (run.json)" if (folder / "run.json").exists() else "files"
        raise PreflightError(
            f"output_dir {folder} already holds {what}; training there would overwrite them. "
            "Give a new (or empty) folder, or move that one away",
            code="output_exists",
        )


def _check_writable(folder: Path) -> None:
    """Make (and remove) an empty folder where ``folder`` is or would be made: permission bits
    do not say it (root passes every ``access`` check, and ``/proc`` refuses even root)."""
    place = folder
    while not os.path.lexists(place) and place != place.parent:
        place = place.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".diffusion-engine-probe-", dir=place))
    except OSError as exc:
        raise PreflightError(
            f"output_dir {folder} cannot be written: making a folder in {place} failed "
            f"({exc.strerror or type(exc).__name__}); give a folder you can write",
            code="output_not_writable",
        ) from None
