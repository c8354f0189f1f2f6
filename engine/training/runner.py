"""A training run in a spawned child process, watched from the parent.

The child gets the whole :class:`TrainingPlan` (it decides nothing anew),
sends events back on one queue (phase, started, progress, completed /
stopped / cancelled, error) and reads stop requests from another. The parent
folds events into the :class:`RunRecord` and writes it atomically. A child
that dies without saying why (killed, out of memory, a segfault in a
kernel) becomes a failed run whose record names the exit code.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.training.preflight import TrainingPlan
from engine.training.records import RunRecord, write_charts


def new_run_id(family: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{family}-{uuid.uuid4().hex[:6]}"


class TrainingRun:
    """One run: start it, poll it, stop it. Not shared between threads."""

    def __init__(self, plan: TrainingPlan, runs_root: Path, run_id: str | None = None) -> None:
        self.plan = plan
        run_id = run_id or new_run_id(plan.family.name)
        folder = Path(plan.config.output_dir) if plan.config.output_dir else Path(runs_root) / run_id
        self.record = RunRecord(
            run_id=run_id,
            folder=folder.resolve(),
            family=plan.family.name,
            base_model=plan.config.base_model,
            config=plan.config.public_dict(),
            plan=plan.to_dict(),
            steps=plan.steps,
            history_limit=plan.config.metric_history,
        )
        self._process: Any = None
        self._events: Any = None
        self._control: Any = None
        self.phase = "pending"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> RunRecord:
        context = multiprocessing.get_context("spawn")
        self._events, self._control = context.Queue(), context.Queue()
        self._process = context.Process(
            target=child_main,
            args=(self.plan, str(self.record.folder), self._events, self._control),
            name=f"diffusion-engine-train-{self.record.run_id}",
            daemon=True,
        )
        self.record.save()
        self._process.start()
        return self.record

    def stop(self, *, save: bool = True) -> None:
        """Ask the child to stop after the current step, saving the LoRA or not."""
        if self._control is not None:
            self._control.put("save" if save else "discard")

    def cancel(self) -> None:
        if self._control is not None:
            self._control.put("cancel")

    def kill(self) -> None:
        """End the child at once (a crash, as far as the record is concerned)."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    def poll(self) -> RunRecord:
        """Fold pending events into the record; notice a child that died."""
        changed = self._drain()
        process = self._process
        if process is not None and not self.record.finished and not process.is_alive():
            process.join(timeout=5)
            changed = self._drain() or changed
            if not self.record.finished:
                code = process.exitcode
                why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                self.record.fail(
                    "trainer_died",
                    f"the trainer process ended without finishing ({why}) at step "
                    f"{self.record.step} of {self.record.steps}",
                )
                changed = True
        if changed:
            if self.record.finished:
                self._finish()
            self.record.save()
        return self.record

    def wait(self, timeout: float | None = None, poll_s: float = 0.2) -> RunRecord:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll().finished:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.record.run_id} still running after {timeout} s")
            time.sleep(poll_s)
        return self.record

    def _drain(self) -> bool:
        changed = False
        while self._events is not None:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event.get("type") == "phase":
                self.phase = str(event.get("phase"))
            self.record.apply(event)
            changed = True
        return changed

    def _finish(self) -> None:
        try:
            self.record.outputs.update(write_charts(self.record))
        except (OSError, ValueError, ImportError) as exc:
            self.record.outputs["charts_error"] = str(exc)
        if self._process is not None:
            self._process.join(timeout=10)


def child_main(plan: TrainingPlan, folder: str, events: Any, control: Any) -> None:
    """Entry point of the spawned trainer process."""
    from engine.logs import quiet_library_logs

    quiet_library_logs(progress_bars=False)
    from engine.training.trainer import run_training

    def emit(event: dict[str, object]) -> None:
        events.put(event)

    def should_stop() -> str | None:
        try:
            return str(control.get_nowait())
        except queue.Empty:
            return None

    try:
        emit(run_training(plan, Path(folder), emit, should_stop))
    except EngineError as exc:
        emit({"type": "error", "code": exc.code, "message": exc.message})
    except Exception as exc:  # the child reports every failure; the parent decides
        emit({
            "type": "error",
            "code": "trainer_crashed",
            "message": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=8),
        })
