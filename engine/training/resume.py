"""Which recorded run a resume continues, and from which checkpoint.

Shared by :meth:`engine.Engine.training.start` (which re-checks right
before the start) and the CLI (which reads the run's config first, to
layer the flags over it): one rule, so both refuse the same runs with the
same codes.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import EngineError
from engine.requests.training import TrainingConfig
from engine.training.checkpoints import check_checkpoint, latest_checkpoint
from engine.training.records import RECORD_NAME, RunRecord, find_run


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


#: Settings a resumed run may change: how long it goes on and what it writes along
#: the way. Anything else (rank, targets, base, family, precision, resolution, data,
#: optimizer, batch...) shapes the weights, the optimizer state or the batch order the
#: checkpoint holds: changing it would crash the trainer or continue a different run.
RESUMABLE_CHANGES = frozenset({
    "steps", "epochs", "save_every", "keep_checkpoints", "sample_prompts", "sample_every", "sample_steps",
    "metric_history", "export_kohya", "strict", "prompt_cache", "prompt_cache_dir", "compile", "gradient_checkpointing",
    "join_timeout",
})
#: Fields that belong to one start of a run, never compared.
_THIS_START = frozenset({"output_dir", "resume_from"})


class ResumeMismatch(EngineError):
    """A resume asks for a setting its checkpoint cannot honour."""

    code = "resume_mismatch"


def checkpoint_run(checkpoint: Path) -> RunRecord | None:
    """The run a checkpoint folder belongs to (``RUN/checkpoints/step-N``), if it has a record."""
    folder = Path(checkpoint).parent.parent
    if not (folder / RECORD_NAME).is_file():
        return None
    try:
        return RunRecord.load(folder / RECORD_NAME)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def resume_changes(recorded: dict[str, object], config: TrainingConfig) -> dict[str, tuple[object, object]]:
    """``{field: (recorded, asked)}`` for every setting the resume changes.

    :raises ResumeMismatch: a change the checkpoint cannot honour, naming the field(s).
    """
    asked = config.public_dict()
    changes: dict[str, tuple[object, object]] = {}
    for name, field in TrainingConfig.model_fields.items():
        if name in _THIS_START:
            continue
        before = recorded.get(name, _jsonable(field.default))
        after = asked.get(name, _jsonable(field.default))
        if not _same(name, before, after):
            changes[name] = (before, after)
    refused = sorted(name for name in changes if name not in RESUMABLE_CHANGES)
    if refused:
        listed = "; ".join(f"{name}: the run has {changes[name][0]!r}, the resume asks {changes[name][1]!r}"
                           for name in refused)
        raise ResumeMismatch(
            f"the checkpoint cannot honour a resume that changes {', '.join(refused)} ({listed}). "
            "A resume may change only how long the run goes on and what it writes "
            f"({', '.join(sorted(RESUMABLE_CHANGES))}); start a new run for other settings"
        )
    return changes


def _jsonable(value: object) -> object:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return value


def _same(name: str, before: object, after: object) -> bool:
    if isinstance(before, (list, tuple)) and isinstance(after, (list, tuple)):
        return list(before) == list(after)
    if name in ("base_model", "dataset_dir") and isinstance(before, str) and isinstance(after, str):
        # The same folder however it was typed (a relative path from another working directory).
        if before != after and Path(before).exists() and Path(after).exists():
            return os.path.realpath(before) == os.path.realpath(after)
    return before == after


def check_resume(config: TrainingConfig) -> tuple[tuple[str, object, object], ...]:
    """A resume's checkpoint checked (readable without executing anything) and its
    settings compared with its run's: the changes it makes, ``(field, recorded, asked)``.

    Torch-free and before anything is evicted; a new run (no ``resume_from``) has none.

    :raises CheckpointUnreadable: the checkpoint's state cannot be read safely.
    :raises ResumeMismatch: a setting the checkpoint cannot honour changed.
    """
    if config.resume_from is None:
        return ()
    record = checkpoint_run(Path(config.resume_from))
    # A checkpoint folder without its run's record has nothing to compare with. The settings
    # first: a resume at another rank is a mismatch, not an unreadable checkpoint.
    changes = resume_changes(record.config, config) if record is not None else {}
    check_checkpoint(Path(config.resume_from), rank=config.lora_rank)
    return tuple((name, before, after) for name, (before, after) in changes.items())
