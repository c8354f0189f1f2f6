"""``engine.training``: plan, start, follow, stop and list LoRA runs.

A run is a child process (:mod:`engine.training.runner`); one watcher thread
per run folds its events into the run record and gives the job, the GPU and
the run lock back when it ends. The checks and the order of a start are the
engine's (see :mod:`engine.service.facade`): every preflight, then the reservation,
then eviction, then the child.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engine.contract.plugins import Registry
from engine.errors import Busy, EngineError
from engine.policy.info import training_info
from engine.requests.training import TrainingConfig
from engine.service.machine import Machine, capabilities
from engine.service.slot import TRAINER, JobSlot
from engine.training.lock import RunLock
from engine.training.preflight import preflight_training
from engine.training.records import RunRecord, list_runs, write_error_code

__all__ = ["TRAINER", "Training"]


class Training:
    """The training runs of one engine: the one it started (its child, watcher and
    published status) and the runs folder it shares with other engines."""

    def __init__(self, registry: Registry, machine: Machine, slot: JobSlot, runs_dir: Path, *,
                 allow_download: Callable[[], bool], drop_pipeline: Callable[[], bool]) -> None:
        """``drop_pipeline``: release the engine's loaded image pipeline (a start evicts it)."""
        self._registry = registry
        self._machine = machine
        self._slot = slot
        self.runs_dir = runs_dir
        self._allow_download = allow_download
        self._drop_pipeline = drop_pipeline
        self._lock = threading.Lock()
        self._run: Any = None
        self._watcher: threading.Thread | None = None
        #: Set by ``stop(now=True)``; the run's watcher ends the trainer (see :meth:`_watch`).
        self._halt = threading.Event()
        #: The run's status as last published by its watcher (see :meth:`status`).
        self._published: dict[str, object] | None = None

    @property
    def current(self) -> Any:
        """The run this engine started last (a :class:`~engine.training.runner.TrainingRun`), or None."""
        return self._run

    def info(self, *, device: str = "auto", base_model: str | None = None,
             resolution: int | None = None) -> dict[str, object]:
        """Per family: the base precisions a run offers here on ``device`` (auto, cuda, cpu),
        and why each other one is not offered (the Train page reads it for its Device choice).
        With ``base_model`` (and a ``resolution``): that base's family alone, sized from the
        base's own file headers at that resolution, as a run on it would be, not from the
        family's largest checkpoint; nothing is loaded."""
        from engine.policy.training import DEVICES

        if device not in DEVICES:
            raise EngineError(f"device must be one of {', '.join(DEVICES)} (got {device!r})", code="invalid_request")
        hardware = self._machine.available_memory().apply(self._machine.hardware())
        if base_model is None:
            return {f.name: training_info(self._registry, f, hardware, device=device).to_dict()  # type: ignore[arg-type]
                    for f in self._registry.families.values()}
        from engine.preflight.model import resolve_model
        from engine.training.run_memory import memory_request

        config = TrainingConfig.from_data({"base_model": base_model, "dataset_dir": ".",
                                           **({"resolution": resolution} if resolution is not None else {})})
        base = resolve_model(self._registry, config.base_model)
        memory = memory_request(self._registry, base.family, base, config)
        info = training_info(self._registry, base.family, hardware, device=device, memory=memory)  # type: ignore[arg-type]
        return {base.family.name: info.to_dict()}

    def plan(self, config: TrainingConfig | Mapping[str, object]) -> Any:
        """Every training preflight (bounds, family, precision, memory, dataset),
        loading nothing: the plan a start would run, or the refusal it would give.

        A base that is not on this machine (a hub id or checkpoint name not in
        the cache) is sized from its family's table and nothing is downloaded;
        the plan's ``weights`` says so and what a start would fetch (a start
        still needs the weights, or consent to download them)."""
        if not isinstance(config, TrainingConfig):
            config = TrainingConfig.from_data(dict(config))
        return self._preflight(config, fetch=False)

    def _preflight(self, config: TrainingConfig, *, fetch: bool) -> Any:
        """Every training preflight, cheap first: one pass on the light probe (no torch
        on a machine without a GPU), so a doomed run is refused in a fraction of a
        second; then the torch-verified machine (a stub torchao, say), which can only
        take capabilities away, and a second pass only where it did."""
        machine = self._machine
        light = machine.hardware(verify=None)
        plan = preflight_training(self._registry, config, light, machine.available_memory(verify=None),
                                  allow_download=self._allow_download(), fetch=fetch)
        verified = machine.hardware(verify=True)
        if capabilities(verified) == capabilities(light):
            return plan
        return preflight_training(self._registry, config, verified, machine.available_memory(verify=True),
                                  allow_download=self._allow_download(), fetch=fetch)

    def start(
        self, config: TrainingConfig | Mapping[str, object], *, resume: str | None = None
    ) -> dict[str, object]:
        """Start a LoRA run in a child process, after every check has passed.

        Besides this engine's job reservation, the runs folder's run lock must
        be free: a trainer another engine started (one killed since, whose
        child still runs) refuses the start with ``run_in_progress``, before
        anything is evicted.

        ``resume``: a finished run (an id in the runs folder, or its folder)
        to continue from its newest checkpoint (unless ``config.resume_from``
        names another of its checkpoints). The run keeps its id, folder,
        creation time and history up to that checkpoint, so its record reads
        as one run. ``config`` is the whole config of the continued run: the
        caller layers its changes (more steps, say) over the recorded one.
        """
        from engine.training.resume import resumable_run
        from engine.training.runner import TrainingRun

        if not isinstance(config, TrainingConfig):
            config = TrainingConfig.from_data(dict(config))
        previous = None
        if resume is not None:
            previous, checkpoint = resumable_run(self.runs_dir, resume)
            if config.resume_from is None:
                config = config.model_copy(update={"resume_from": checkpoint})
        plan = self._preflight(config, fetch=True)
        from engine.training.canary import training_canary

        canary = training_canary(plan)  # a scheme that breaks a real slice is refused here, before eviction
        if previous is not None:
            run = TrainingRun(plan, self.runs_dir, run_id=previous.run_id, folder=previous.folder)
            run.carry_over(previous)
        else:
            run = TrainingRun(plan, self.runs_dir)
        halt = threading.Event()
        self._slot.reserve("training")
        run_lock = RunLock(self.runs_dir)
        token = None
        try:
            token = self._take_run_lock(run_lock, run)
            self._drop_pipeline()
            self._slot.residency.acquire(TRAINER)
            run.start()
            try:
                run_lock.set_trainer(token, run.pid)
            except OSError:
                pass  # the lock still names this engine; the run's own record write reports the disk
        except BaseException:
            run.kill()
            self._slot.residency.release_if(lambda owner: owner == TRAINER)
            if token is not None:
                run_lock.release(token)
            self._slot.release("training")
            raise
        watcher = threading.Thread(target=self._watch, args=(run, run_lock, token, halt), daemon=True,
                                   name="engine-run-watch")
        with self._lock:
            self._run, self._watcher, self._halt = run, watcher, halt
        self._publish(run)
        started = {**(self.status() or {}), "canary": canary.to_dict()}
        watcher.start()
        return started

    def _take_run_lock(self, run_lock: RunLock, run: Any) -> str:
        try:
            token, holder = run_lock.acquire(run.record.run_id, run.record.folder)
        except OSError as exc:
            raise EngineError(
                f"cannot write the run lock {run_lock.path}: {exc.strerror or exc}; "
                f"free space in (or fix the permissions of) {self.runs_dir}",
                code=write_error_code(exc),
            ) from exc
        if holder is not None or token is None:
            who = holder.describe() if holder is not None else "another process"
            raise Busy(
                f"a training run is in progress in {self.runs_dir}: {who} is alive (lock "
                f"{run_lock.path}); wait for it to finish, or stop that process, then start again",
                code="run_in_progress",
            )
        return token

    def _watch(self, run: Any, run_lock: RunLock, token: str, halt: threading.Event) -> None:
        """Fold the child's events until the run ends, then give everything back.

        Whatever happens here (a record the disk refuses, a bug), the job,
        the GPU and the run lock are released and the run ends: a dead
        watcher would leave the engine busy forever. The finished status is
        published only after the release, so a client that sees it can
        start the next job at once.
        """
        try:
            while not run.poll().finished:
                if halt.is_set():  # stop(now=True): only this thread touches the child's events
                    run.halt()
                    break
                self._publish(run)
                halt.wait(0.2)
        except Exception as exc:  # any failure here must end the run, not the engine
            run.abort("watcher_failed", f"the engine could not follow the run ({type(exc).__name__}: {exc}); "
                      "the trainer was stopped; start the run again")
        finally:
            self._slot.residency.release_if(lambda owner: owner == TRAINER)
            try:
                run_lock.release(token)
            except OSError:
                pass  # the lock names a trainer that is gone: the next start takes it over
            self._slot.release("training")
            self._publish(run)

    def _publish(self, run: Any) -> None:
        snapshot = {**run.record.to_dict(), "phase": run.phase}
        with self._lock:
            if self._run is run:
                self._published = snapshot

    def status(self) -> dict[str, object] | None:
        """The run's record as its watcher last published it (every 0.2 s).

        Only the watcher polls the child, so events are applied exactly
        once; and it publishes the final status only after it released the
        job, so "completed" (or failed...) always means a new start is welcome.
        """
        with self._lock:
            published = self._published
        return dict(published) if published is not None else None

    def stop(self, *, save: bool = True, now: bool = False) -> dict[str, object]:
        """Stop after the current step, saving the LoRA unless ``save`` is False; the answer's
        ``stopping`` says ``now`` or ``after_step``.

        ``now``: do not wait for the step (a second Ctrl-C): the trainer is
        ended mid-step, the partial step is lost, and the run is stopped
        with its last checkpoint as its output (``save`` does not apply). A run
        that has not trained a step yet (loading its base, caching its inputs,
        or over several machines still waiting for its nodes) stops at once the
        same way: there is nothing to save, and a 14B load would take minutes.
        """
        run = self._run
        if run is None or run.record.finished:
            raise EngineError("no training run is in progress", code="not_training")
        at_once = now or run.awaiting_nodes or run.record.status == "pending"
        if at_once:
            self._halt.set()
        else:
            run.stop(save=save)
        return {**(self.status() or {}), "stopping": "now" if at_once else "after_step"}

    def cancel(self) -> dict[str, object]:
        """Stop the run at its next check (any phase) and keep no LoRA; its checkpoints stay."""
        run = self._run
        if run is None or run.record.finished:
            raise EngineError("no training run is in progress", code="not_training")
        run.cancel()
        return self.status() or {}

    def wait(self, timeout: float | None = None) -> RunRecord:
        """Block until the run has finished and the watcher gave the GPU back."""
        with self._lock:
            run, watcher = self._run, self._watcher
        if run is None or watcher is None:
            raise EngineError("no training run was started", code="not_training")
        watcher.join(timeout)
        if watcher.is_alive():
            raise TimeoutError(f"run {run.record.run_id} still running after {timeout} s")
        return run.record

    def runs(self) -> list[dict[str, object]]:
        """Every run in the runs folder; one whose processes are gone reads as failed."""
        run = self._run
        if run is not None and run.record.finished:
            run.flush()  # a final record the full disk refused is written once it can be
        return [r.to_dict() for r in list_runs(self.runs_dir)]

    def run(self, run_id: str, *, by_path: bool = True) -> dict[str, object]:
        """One run's record, with its files: ``run_id`` is an id in the runs folder, or
        (``by_path``) a run folder anywhere (a server passes ``by_path=False``)."""
        record = self._named_run(run_id, by_path)
        return {**record.to_dict(), "files": self.files(run_id, by_path=by_path)}

    def files(self, run_id: str, *, by_path: bool = True) -> list[str]:
        """The files in a run's folder, relative to it (LoRAs, checkpoints, samples, record)."""
        from engine.training.records import run_files

        return sorted(run_files(self._named_run(run_id, by_path).folder))

    def remove(self, run_id: str, *, by_path: bool = True) -> dict[str, object]:
        """Delete a finished run's folder; a run still going is refused (``run_in_progress``)."""
        import shutil

        record = self._named_run(run_id, by_path)
        if not record.finished:
            raise EngineError(f"run {record.run_id} is still {record.status} (PID {record.pid}); stop it first",
                              code="run_in_progress")
        folder, runs = Path(record.folder), Path(os.path.realpath(self.runs_dir))
        if folder.is_symlink() or Path(os.path.realpath(folder)) in (runs, *runs.parents):
            raise EngineError(f"refusing to delete {folder}: it is a symlink, or holds the runs folder "
                              f"{self.runs_dir}; remove it by hand if it really is a run", code="run_not_removable")
        shutil.rmtree(folder)
        return {"run_id": record.run_id, "folder": str(record.folder), "removed": True}

    def resume_point(self, run_id: str) -> dict[str, object]:
        """What resuming ``run_id`` continues from: its recorded config (to layer changes on) and
        its newest checkpoint; refused as :meth:`start` would (``run_not_found``,
        ``run_in_progress``, ``no_checkpoint``)."""
        from engine.training.resume import resumable_run

        record, checkpoint = resumable_run(self.runs_dir, run_id)
        return {"run_id": record.run_id, "folder": str(record.folder), "config": dict(record.config),
                "checkpoint": str(checkpoint)}

    def _named_run(self, run_id: str, by_path: bool = True) -> RunRecord:
        from engine.training.records import find_run

        plain = by_path or not (run_id.startswith(".") or "/" in run_id or "\\" in run_id)
        record = find_run(self.runs_dir, run_id, paths=by_path) if run_id and plain else None
        if record is None:
            raise EngineError(f"no run {run_id!r} in {self.runs_dir}; list the runs (`diffusion-engine runs`, "
                              "or GET /v1/training/runs) and pass one of their ids", code="run_not_found")
        return record

