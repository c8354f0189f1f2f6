"""Which recorded run a resume continues, and from which checkpoint.

Shared by :meth:`engine.Engine.start_training` (which re-checks right
before the start) and the CLI (which reads the run's config first, to
layer the flags over it): one rule, so both refuse the same runs with the
same codes.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import EngineError
from engine.training.checkpoints import latest_checkpoint
from engine.training.records import RunRecord, find_run


def resumable_run(runs_dir: Path, name: str) -> tuple[RunRecord, Path]:
    """The finished run ``name`` names (an id in ``runs_dir``, or a run folder) and its newest checkpoint.

    :raises EngineError: ``run_not_found``, ``run_in_progress`` (its trainer
        is alive: two trainers must not write one folder) or ``no_checkpoint``.
    """
    record = find_run(Path(runs_dir), name)
    if record is None:
        raise EngineError(
            f"no run of id {name!r} in {runs_dir} and no run folder at that path; "
            "list the runs (`diffusion-engine runs`, or GET /v1/training/runs) and pass one of their ids",
            code="run_not_found",
        )
    if record.status in ("pending", "running"):
        raise EngineError(
            f"run {record.run_id} is still {record.status} (PID {record.pid}); stop it before resuming it",
            code="run_in_progress",
        )
    checkpoint = latest_checkpoint(record.folder)
    if checkpoint is None:
        raise EngineError(
            f"run {record.run_id} has no checkpoint in {record.folder / 'checkpoints'} to resume from; "
            "runs write them when started with save_every (--save-every N)",
            code="no_checkpoint",
        )
    return record, checkpoint
