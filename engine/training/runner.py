"""A training run in a child process, watched from the parent.

The child (``python -m engine.training.child``, see there why not
``multiprocessing``) gets the whole :class:`TrainingPlan` (it decides
nothing anew), sends events back on one socket (phase, started, progress,
checkpoint, completed / stopped / cancelled, error) and reads stop requests
from it. The parent folds events into the :class:`RunRecord` and writes it
atomically. A child that dies without saying why (killed, out of memory, a
segfault in a kernel) becomes a failed run whose record names the exit code.

Reliability rules, each learned from a run that outlived its welcome:

* The child dies with its parent. On Linux it asks the kernel for SIGKILL
  when its parent goes (``PR_SET_PDEATHSIG``); everywhere, a thread in the
  child watches the parent PID, and its socket reads EOF, and either ends it.
  The kernel ties that signal to the *thread* that spawned the child, so the
  child is spawned from a keeper thread that lives exactly as long as it
  (a server's request thread may end long before the run).
* The child has its own session (so process group) and ignores SIGINT: a terminal's
  Ctrl-C reaches the CLI only, which asks for a stop that saves.
* The record names the trainer's PID and start time, so a reader can tell a
  live run from one whose processes are gone (see :mod:`records`).
* A record that cannot be written (a full disk) is an error of the run: the
  run fails with ``disk_full`` and the child is stopped; ``poll`` never
  raises for it, so whoever watches the run always sees it finish.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from engine.errors import EngineError
from engine.training.lock import ProcessId
from engine.training.preflight import TrainingPlan
from engine.training.process import Child, start_child
from engine.training.records import DISK_FULL, RunRecord, write_charts, write_error_code

def new_run_id(family: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{family}-{uuid.uuid4().hex[:6]}"


class TrainingRun:
    """One run: start it, poll it, stop it. One thread polls; ``flush`` may come from another."""

    def __init__(
        self, plan: TrainingPlan, runs_root: Path, run_id: str | None = None, folder: Path | None = None
    ) -> None:
        """``folder``: an existing run's folder (a resumed run continues in it)."""
        self.plan = plan
        run_id = run_id or new_run_id(plan.family.name)
        if folder is None:
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
        self._process: Child | None = None
        #: The step a resumed run continues from (None: a new run).
        self._resumed_at: int | None = None
        self._unsaved = False
        self.phase = "pending"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> RunRecord:
        """Write the record, start the child, and write the record again naming it.

        :raises EngineError: ``disk_full`` / ``write_failed`` when the record
            cannot be written (the child is then not left running).
        """
        self.record.set_owner(ProcessId.current())
        self._save_or_raise()
        self._write_config()
        try:
            self._process = start_child(self.plan, self.record.folder, self.record.run_id)
            self.record.set_trainer(ProcessId.of(self._process.pid))
            self._save_or_raise()
        except EngineError as exc:
            self.abort(exc.code, exc.message)
            raise
        except Exception as exc:  # a start that failed: the record must not stay "pending"
            self.abort("trainer_start_failed", f"the trainer process could not start: {type(exc).__name__}: {exc}")
            raise
        return self.record

    def carry_over(self, previous: RunRecord) -> None:
        """A resumed run keeps its creation time and its history up to the checkpoint it resumes from."""
        from engine.training.checkpoints import checkpoint_step

        resume_from = self.plan.config.resume_from
        upto = checkpoint_step(Path(resume_from)) if resume_from is not None else 0
        self.record.created_at = previous.created_at
        for name, history in previous.metrics.items():
            if name in self.record.metrics:
                self.record.metrics[name].points = [(s, v) for s, v in history.points if s <= upto]
        self.record.samples = [s for s in previous.samples if int(s.get("step", 0)) <= upto]  # type: ignore[call-overload]
        self.record.step = upto
        self.record.segments = [*previous.segments, {
            "from_step": upto, "started_at": time.time(),
            "changes": {name: [before, after] for name, before, after in self.plan.resume_changes},
        }]
        self._resumed_at = upto

    def _write_config(self) -> None:
        """``config.toml`` beside the record: ``train --config`` with it repeats the run.

        A resumed run keeps the file its first segment wrote (the past is not
        rewritten) and writes its own settings beside it, named by the step it
        resumed from."""
        from engine.training.config import config_toml

        name = "config.toml" if self._resumed_at is None else f"config.resumed-{self._resumed_at:08d}.toml"
        path = self.record.folder / name
        try:
            path.write_text(config_toml(self.plan.config), encoding="utf-8")
        except OSError as exc:
            self.abort(write_error_code(exc), self._write_failed_message(exc))
            raise EngineError(self._write_failed_message(exc), code=write_error_code(exc)) from exc
        self.record.outputs["config"] = str(path)

    @property
    def awaiting_nodes(self) -> bool:
        """A run over several machines whose ranks have not all joined yet: nothing is trained,
        and its ranks wait in the rendezvous, where no stop request is read."""
        return int(self.plan.config.nodes) > 1 and self.record.ranks is None and not self.record.finished

    def stop(self, *, save: bool = True) -> None:
        """Ask the child to stop after the current step (or phase), saving the LoRA or not."""
        if self._process is not None:
            self._process.send("save" if save else "discard")

    def cancel(self) -> None:
        """Ask the child to stop at the next check and keep nothing of this run."""
        if self._process is not None:
            self._process.send("cancel")

    def halt(self) -> RunRecord:
        """Stop now: end the child mid-step; the run is stopped, its last checkpoint kept.

        The partial step is discarded. The second Ctrl-C at the CLI comes here.
        """
        self.kill()
        self._drain()
        if not self.record.finished:
            self.record.apply({"type": "stopped", "outputs": self._latest_outputs()})
            self.record.error = None
            self.phase = self.record.status
            self._unsaved = True
            self.flush()
        return self.record

    def _latest_outputs(self) -> dict[str, str]:
        """The last checkpoint, and its LoRA copied to the run's top level (where a finished
        run's LoRA is, so ``generate --lora RUN`` and the LoRA roots find it), saying so."""
        import shutil

        from engine.training.checkpoints import latest_checkpoint, remove_partial
        from engine.training.export import LORA_WEIGHTS

        remove_partial(self.record.folder)  # the child may have died mid-write
        latest = latest_checkpoint(self.record.folder)
        if latest is None:
            return {}
        outputs = {"checkpoint": str(latest)}
        lora = latest / LORA_WEIGHTS
        if lora.is_file():
            top = self.record.folder / LORA_WEIGHTS
            temporary = top.with_name(f".{LORA_WEIGHTS}.tmp")
            try:
                shutil.copyfile(lora, temporary)
                os.replace(temporary, top)
                outputs.update(lora=str(top), lora_from_checkpoint=str(latest))
            except OSError:
                temporary.unlink(missing_ok=True)
        return outputs

    def kill(self) -> None:
        """End the child at once (a crash, as far as the record is concerned)."""
        process = self._process
        if process is not None and process.is_alive():
            process.kill()
            process.join(timeout=10)

    def abort(self, code: str, message: str) -> RunRecord:
        """Fail the run for a reason found on this side (the record, the watcher): stop the child."""
        self.kill()
        self._drain()
        self.record.fail(code, message)
        self._unsaved = True
        self.flush()
        return self.record

    def flush(self) -> bool:
        """Write a record the disk refused before (it was full); True once it is on disk.

        Until then the file may say "running" for a run this process ended;
        whoever lists runs in this process calls this first.
        """
        if self._unsaved:
            try:
                self.record.save()
            except OSError:
                return False
            self._unsaved = False
        return True

    def poll(self) -> RunRecord:
        """Fold pending events into the record; notice a child that died.

        Never raises for a record it cannot write: that fails the run.
        """
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
                self.phase = self.record.status  # the phase ends in the terminal state
                self._finish()
            try:
                self.record.save()
            except OSError as exc:
                self.abort(write_error_code(exc), self._write_failed_message(exc))
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
        for event in self._process.events() if self._process is not None else ():
            if event.get("type") == "phase":
                self.phase = str(event.get("phase"))
            self.record.apply(event)
            changed = True
        return changed

    def _save_or_raise(self) -> None:
        try:
            self.record.save()
        except OSError as exc:
            raise EngineError(self._write_failed_message(exc), code=write_error_code(exc)) from exc

    def _write_failed_message(self, exc: OSError) -> str:
        what = "the disk is full" if exc.errno in DISK_FULL else (exc.strerror or str(exc))
        return (
            f"cannot write the run record {self.record.path}: {what}; the trainer was stopped at "
            f"step {self.record.step} of {self.record.steps}. Free space in {self.record.folder.parent} "
            "(or choose another output_dir) and start the run again"
        )

    def _finish(self) -> None:
        try:
            self.record.outputs.update(write_charts(self.record))
        except (OSError, ValueError, ImportError) as exc:
            self.record.outputs["charts_error"] = str(exc)
        if self._process is not None:
            self._process.join(timeout=10)
