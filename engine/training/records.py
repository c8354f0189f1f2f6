"""Run records: one JSON file per run, written atomically, with bounded history.

The record is what ``diffusion-engine runs`` lists and what a UI polls: the
config (nothing secret), the resolved plan, progress, metric history
(thinned to at most ``limit`` points per metric, so a 100k-step run stays a
small file), outputs and, for a failed run, the error. Files are utf-8 so
non-ASCII prompts survive on every platform.

A record also names the processes behind it: the engine that started the
run and, once spawned, the trainer child (PID and start time). Events can
stop arriving for good (the engine was killed, the machine rebooted); so a
record that says pending or running is checked against those processes
whenever it is read, and one whose processes are gone is failed there and
then. A record never says "running" for a run nobody runs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from engine import stored
from engine.places import within
from engine.training import json_files
from engine.training.lock import ProcessId, RunId

log = logging.getLogger(__name__)

Status = Literal["pending", "running", "completed", "stopped", "cancelled", "failed"]
TERMINAL: tuple[str, ...] = ("completed", "stopped", "cancelled", "failed")
#: ``loss_scale``: the fp16 GradScaler's scale (absent without loss scaling).
METRICS: tuple[str, ...] = ("loss", "lr", "grad_norm", "samples_per_s", "loss_scale")
RECORD_NAME = "run.json"
#: errno values that mean "the disk (or the user's quota) is full".
DISK_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


def write_error_code(exc: OSError) -> str:
    """The stable code for a failed write: ``disk_full`` or ``write_failed``."""
    return "disk_full" if exc.errno in DISK_FULL else "write_failed"


def error_event(exc: BaseException) -> dict[str, object]:
    """The ``error`` event a trainer process reports for ``exc``: an engine error's
    own code and message; a full disk (with what to do); anything else
    ``trainer_crashed``, with its traceback for the record."""
    import traceback

    from engine.errors import EngineError

    if isinstance(exc, EngineError):
        return {"type": "error", "code": exc.code, "message": exc.message}
    full = isinstance(exc, OSError) and exc.errno in DISK_FULL
    return {
        "type": "error",
        "code": write_error_code(exc) if full else "trainer_crashed",  # type: ignore[arg-type]
        "message": f"{type(exc).__name__}: {exc}" + ("; free space in the output folder and start again" if full else ""),
        "traceback": traceback.format_exc(limit=8),
    }


Count = Annotated[int, Field(ge=0, le=10**9)]


@dataclass
class MetricHistory:
    """(step, value) points; when full, every other point is dropped."""

    limit: Annotated[int, Field(ge=1, le=100_000)]
    points: list[tuple[int, float]] = field(default_factory=list)

    def add(self, step: int, value: float) -> None:
        self.points.append((step, value))
        if len(self.points) > self.limit:
            self.points = self.points[::2]


@dataclass
class RunRecord:
    run_id: RunId
    folder: Path
    family: str
    base_model: str
    config: dict[str, object]
    plan: dict[str, object]
    status: Status = "pending"
    step: Count = 0
    steps: Count = 0
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    peak_memory_gb: float | None = None
    metrics: dict[str, MetricHistory] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    #: Sample images written during the run: ``{"step", "prompt", "path"}`` each.
    samples: list[dict[str, object]] = field(default_factory=list)
    error: dict[str, str] | None = None
    history_limit: Annotated[int, Field(ge=1, le=100_000)] = 500
    #: The engine process that started the run and the trainer child (PID,
    #: start time in clock ticks): what liveness is checked against.
    owner_pid: int | None = None
    owner_started: int | None = None
    pid: int | None = None
    pid_started: int | None = None
    #: A multi-GPU run's ranks: ``world``, their ``pids`` and, at the end,
    #: each rank's LoRA digest (``lora_sha256``, equal when in sync); None for one process.
    ranks: dict[str, object] | None = None
    #: Each resume of the run: ``{"from_step", "started_at", "changes": {field: [before, after]}}``.
    #: The settings a resume may change (more steps, another save cadence) are recorded
    #: here as they apply from that step on; what came before is never rewritten.
    segments: list[dict[str, object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in METRICS:
            self.metrics.setdefault(name, MetricHistory(self.history_limit))

    @property
    def path(self) -> Path:
        return self.folder / RECORD_NAME

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def apply(self, event: dict[str, object]) -> None:
        """Fold one event from the trainer into the record."""
        kind = event.get("type")
        if isinstance(event.get("ranks"), dict):
            self.ranks = {**(self.ranks or {}), **event["ranks"]}  # type: ignore[dict-item]
        if kind == "started":
            self.status = "running"
            self.started_at = time.time()
            self.steps = int(event.get("steps", self.steps))  # type: ignore[arg-type]
        elif kind == "progress":
            self.step = int(event["step"])  # type: ignore[arg-type]
            for name in METRICS:
                value = event.get(name)
                if isinstance(value, (int, float)):
                    self.metrics[name].add(self.step, float(value))
            peak = event.get("peak_memory_gb")
            if isinstance(peak, (int, float)):
                self.peak_memory_gb = max(self.peak_memory_gb or 0.0, float(peak))
        elif kind == "samples":
            self.samples.extend(dict(s) for s in event.get("samples") or [])  # type: ignore[union-attr]
        elif kind == "checkpoint":
            self.outputs["checkpoint"] = str(event.get("path"))
        elif kind in ("completed", "stopped", "cancelled"):
            self.status = kind  # type: ignore[assignment]
            self.finished_at = time.time()
            self.outputs.update({k: str(v) for k, v in dict(event.get("outputs") or {}).items()})  # type: ignore[arg-type]
        elif kind == "error":
            self.fail(str(event.get("code", "trainer_error")), str(event.get("message", "")))

    def set_owner(self, process: ProcessId) -> None:
        self.owner_pid, self.owner_started = process.pid, process.started

    def set_trainer(self, process: ProcessId) -> None:
        self.pid, self.pid_started = process.pid, process.started

    def orphaned(self) -> bool:
        """Unfinished, yet the process that would finish it is gone.

        The trainer child decides once it was spawned; before that, the
        engine that started the run. A record naming neither (written by an
        older version) cannot be judged and is left as it says; nor is one
        this very process started: its watcher, which outlives the child,
        writes how it ended (a completed child is gone before that lands).
        """
        if self.finished:
            return False
        if self.owner_pid is not None and ProcessId(self.owner_pid, self.owner_started) == ProcessId.current():
            return False
        if self.pid is not None:
            return not ProcessId(self.pid, self.pid_started).alive()
        if self.owner_pid is not None:
            return not ProcessId(self.owner_pid, self.owner_started).alive()
        return True

    def fail(self, code: str, message: str) -> None:
        self.status = "failed"
        self.finished_at = time.time()
        self.error = {"code": code, "message": message}

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["folder"] = str(self.folder)
        data["metrics"] = {name: [list(p) for p in h.points] for name, h in self.metrics.items()}
        return data

    def save(self) -> None:
        json_files.write_json_atomic(self.path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        """Read a record; one left unfinished by a process that is gone comes back failed.

        The failure is written back when the disk allows (reading never
        fails for a read-only or full disk).
        """
        data = stored.read_json(path, root=path.parent)
        if not isinstance(data, dict):
            raise stored.UnreadableRecord(path, "it is not a JSON object")
        limit = data.get("history_limit", 500)
        metrics = data.get("metrics", {})
        if isinstance(metrics, dict) and isinstance(limit, int):
            data["metrics"] = {name: {"limit": limit, "points": points} for name, points in metrics.items()}
        # A run is where its record was found: a ``folder`` written inside the record (a
        # copied or planted run) never sends a delete, a listing or a resume anywhere else.
        record: RunRecord = stored.validated(path, RunRecord, data,
                                             identity={"folder": os.path.abspath(path.parent)})
        if record.orphaned():
            record.fail("trainer_gone", record._gone_message())
            with contextlib.suppress(OSError):
                record.save()
        return record

    def _gone_message(self) -> str:
        if self.pid is not None:
            who = f"trainer process {self.pid}"
        elif self.owner_pid is not None:
            who = f"engine process {self.owner_pid}"
        else:
            who = "writer (the record names no process)"
        return (
            f"the record said {self.status} at step {self.step} of {self.steps}, but its {who} is gone "
            "(the engine or CLI was killed, or the machine restarted); start the run again"
        )


def inside(root: Path, path: Path) -> bool:
    """Whether ``path``, symlinks resolved, lies strictly below ``root`` (resolved too)."""
    return within(root, path, strictly=True)


def find_run(root: Path, name: str, *, paths: bool = True) -> RunRecord | None:
    """The run ``name`` names: an id in ``root`` (or a folder there), or (with
    ``paths``) a run folder's path; a server passes ``paths=False`` and a plain name.

    A folder looked up in ``root`` must stay inside it once symlinks are resolved;
    an unreadable record there names no run.
    """
    candidates = [(Path(root) / name, True)] + ([(Path(name), False)] if paths else [])
    for folder, in_root in candidates:
        if in_root and not inside(root, folder):
            continue
        if (folder / RECORD_NAME).is_file():
            try:
                return RunRecord.load(folder / RECORD_NAME)
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                return None
    return next((r for r in list_runs(root) if r.run_id == name), None)  # a run with its own --output name


#: The most runs a listing reads (newest names first), and the most files one run lists.
MAX_RUNS = 1000
MAX_RUN_FILES = 500


def list_runs(root: Path, limit: int = MAX_RUNS) -> list[RunRecord]:
    """Every readable run record directly under ``root``, newest first; a folder that is
    a symlink leading out of ``root`` is not a run of it."""
    records = []
    try:
        folders = sorted((entry for entry in os.scandir(root) if not entry.name.startswith(".")),
                         key=lambda entry: entry.name, reverse=True)
    except OSError:
        return []
    for entry in folders:
        path = Path(entry.path) / RECORD_NAME
        if len(records) >= limit or not inside(root, Path(entry.path)) or not path.is_file():
            continue
        try:
            records.append(RunRecord.load(path))
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            log.warning("run record %s is skipped: %s", path, getattr(exc, "message", exc))
            continue  # a record being written for the first time, or foreign
    return sorted(records, key=lambda r: r.created_at, reverse=True)


def run_files(folder: Path, limit: int = MAX_RUN_FILES) -> list[str]:
    """The plain files in a run's folder, relative to it; symlinks are never followed nor
    listed, and the walk stops at ``limit`` files, so a huge folder costs no more."""
    found: list[str] = []
    for top, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            path = Path(top) / name
            if not path.is_symlink() and path.is_file():
                found.append(path.relative_to(folder).as_posix())
                if len(found) >= limit:
                    return found
    return found


def write_charts(record: RunRecord) -> dict[str, str]:
    """Loss, learning-rate and pre-clip grad-norm charts as PNGs beside the record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: dict[str, str] = {}
    for name, label in (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm (pre-clip)")):
        points = record.metrics[name].points
        if not points:
            continue
        figure, axis = plt.subplots(figsize=(6, 3.2), dpi=100)
        axis.plot([s for s, _ in points], [v for _, v in points], linewidth=1.2)
        axis.set_xlabel("step")
        axis.set_ylabel(label)
        axis.set_title(f"{record.family} LoRA: {label}")
        axis.grid(alpha=0.3)
        figure.tight_layout()
        path = record.folder / f"chart_{name}.png"
        figure.savefig(path)
        plt.close(figure)
        written[f"chart_{name}"] = str(path)
    return written
