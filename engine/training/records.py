"""Run records: one JSON file per run, written atomically, with bounded history.

The record is what ``diffusion-engine runs`` lists and what a UI polls: the
config (nothing secret), the resolved plan, progress, metric history
(thinned to at most ``limit`` points per metric, so a 100k-step run stays a
small file), outputs and, for a failed run, the error. Files are utf-8 so
non-ASCII prompts survive on every platform.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Status = Literal["pending", "running", "completed", "stopped", "cancelled", "failed"]
TERMINAL: tuple[str, ...] = ("completed", "stopped", "cancelled", "failed")
METRICS: tuple[str, ...] = ("loss", "lr", "grad_norm", "samples_per_s")
RECORD_NAME = "run.json"


def write_json_atomic(path: Path, data: object) -> None:
    """Write ``data`` as utf-8 JSON to ``path`` via a temp file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=2, ensure_ascii=False)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


@dataclass
class MetricHistory:
    """(step, value) points; when full, every other point is dropped."""

    limit: int
    points: list[tuple[int, float]] = field(default_factory=list)

    def add(self, step: int, value: float) -> None:
        self.points.append((step, value))
        if len(self.points) > self.limit:
            self.points = self.points[::2]


@dataclass
class RunRecord:
    run_id: str
    folder: Path
    family: str
    base_model: str
    config: dict[str, object]
    plan: dict[str, object]
    status: Status = "pending"
    step: int = 0
    steps: int = 0
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    peak_memory_gb: float | None = None
    metrics: dict[str, MetricHistory] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    error: dict[str, str] | None = None
    history_limit: int = 500

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
        elif kind in ("completed", "stopped", "cancelled"):
            self.status = kind  # type: ignore[assignment]
            self.finished_at = time.time()
            self.outputs.update({k: str(v) for k, v in dict(event.get("outputs") or {}).items()})  # type: ignore[arg-type]
        elif kind == "error":
            self.fail(str(event.get("code", "trainer_error")), str(event.get("message", "")))

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
        write_json_atomic(self.path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        data = json.loads(path.read_text(encoding="utf-8"))
        limit = int(data.get("history_limit", 500))
        data["folder"] = Path(data["folder"])
        data["metrics"] = {
            name: MetricHistory(limit, [(int(s), float(v)) for s, v in points])
            for name, points in data.get("metrics", {}).items()
        }
        return cls(**data)


def list_runs(root: Path) -> list[RunRecord]:
    """Every readable run record under ``root``, newest first."""
    records = []
    for path in sorted(Path(root).glob(f"*/{RECORD_NAME}")):
        try:
            records.append(RunRecord.load(path))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a record being written for the first time, or foreign
    return sorted(records, key=lambda r: r.created_at, reverse=True)


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
