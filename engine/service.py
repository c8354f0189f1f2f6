"""``Engine``: the facade apps embed and the HTTP server serves.

Every load and every training start runs in one order:

    validate -> precision preflight -> base / model checks -> dataset decode
    -> reserve (a Busy error if another job holds the engine)
    -> acquire the GPU (evict residents) -> start

so nothing is evicted before the last cheap check passed. The rule for jobs:
one GPU job at a time. Starting a training run evicts a loaded image
pipeline (and the host's residents); loading a pipeline while a run trains
is refused with :class:`Busy` (HTTP 409), as is a second training start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engine.errors import EngineError, UnknownName
from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry, load_registry
from engine.policy.inference import InferenceRequest, ModelFacts, Plan, plan_inference
from engine.policy.info import images_info, training_info
from engine.preflight.model import resolve_model
from engine.residency import Residency, Resident
from engine.training.config import TrainingConfig
from engine.training.preflight import preflight_training
from engine.training.records import RunRecord, list_runs

PIPELINE = "engine.pipeline"
TRAINER = "engine.trainer"


class Busy(EngineError):
    """Another job holds the engine; try again when it is done."""

    code = "busy"


class Engine:
    """One engine per process. Thread-safe: jobs are reserved under a lock."""

    def __init__(
        self,
        *,
        registry: Registry | None = None,
        hardware: HardwareProfile | None = None,
        runs_dir: Path | str = "runs",
        residency: Residency | None = None,
    ) -> None:
        self.registry = registry or load_registry()
        self.residency = residency or Residency()
        self.runs_dir = Path(runs_dir)
        self._hardware = hardware
        self._lock = threading.Lock()
        self._job: str | None = None
        self._session: Any = None
        self._run: Any = None
        self._load_phase = "idle"

    # -- machine --------------------------------------------------------------

    def hardware(self, *, verify: bool | None = None) -> HardwareProfile:
        """The machine decisions are made for: the one given, else a probe."""
        if self._hardware is not None:
            return self._hardware
        from engine.hardware.probe import probe

        return probe(verify=verify)

    # -- light questions ------------------------------------------------------------

    def families(self) -> list[dict[str, object]]:
        return [
            {"name": f.name, "label": f.label, "aliases": list(f.aliases),
             "checkpoints": [c.name for c in f.checkpoints]}
            for f in self.registry.families.values()
        ]

    def info(self) -> dict[str, object]:
        hardware = self.hardware()
        return {
            "hardware": hardware.to_dict(),
            "families": {
                f.name: {"images": images_info(self.registry, f).to_dict(),
                         "training": training_info(self.registry, f, hardware).to_dict()}
                for f in self.registry.families.values()
            },
        }

    def train_info(self) -> dict[str, object]:
        hardware = self.hardware()
        return {f.name: training_info(self.registry, f, hardware).to_dict() for f in self.registry.families.values()}

    def plan(
        self,
        model: str | None = None,
        *,
        family: str | None = None,
        checkpoint: str | None = None,
        base: str | None = None,
        request: InferenceRequest = InferenceRequest(),
    ) -> Plan:
        if model is not None:
            facts = resolve_model(self.registry, model, family=family, base=base).facts(self.registry)
        elif family is not None:
            spec = self.registry.family(family)
            chosen = spec.checkpoint(checkpoint) if checkpoint else spec.default_checkpoint
            if chosen is None:
                raise UnknownName("checkpoint", str(checkpoint), [c.name for c in spec.checkpoints])
            facts = ModelFacts(spec, chosen, self.registry.component_sizes(spec, chosen))
        else:
            raise EngineError("give a model path or a family", code="invalid_request")
        return plan_inference(self.registry, facts, self.hardware(), request)

    # -- images -----------------------------------------------------------------

    def load(
        self,
        model: str,
        *,
        base: str | None = None,
        family: str | None = None,
        request: InferenceRequest = InferenceRequest(),
    ) -> dict[str, object]:
        """Load a pipeline; every check runs before anything is evicted."""
        from engine.runtime.session import InferenceSession

        source = resolve_model(self.registry, model, family=family, base=base)
        plan = plan_inference(self.registry, source.facts(self.registry), self.hardware(verify=True), request)
        self._reserve("loading")
        try:
            self._load_phase = "evicting"
            self._drop_session()
            self.residency.acquire(PIPELINE)
            session = InferenceSession(self.registry, source, plan, request)
            self._load_phase = "loading"
            session.load()
            self._session = session
            self.residency.register(Resident(PIPELINE, self._evict_pipeline))
            self._load_phase = "ready"
            return session.status()
        except BaseException:
            self._load_phase = "failed"
            self.residency.release_if(lambda owner: owner == PIPELINE)
            raise
        finally:
            self._release_job("loading")

    def generate(
        self, prompt: str, *, progress: Callable[[int, int], None] | None = None, **options: object
    ) -> list[Any]:
        """Images for ``prompt`` (options: steps, guidance, width, height, seed,
        count, negative_prompt); ``progress(step, total)`` after each step."""
        from engine.runtime.session import GenerateRequest

        session = self._session
        if session is None:
            raise EngineError("no image pipeline is loaded; load one first", code="not_loaded")
        return session.generate(GenerateRequest(prompt=prompt, **options), progress)  # type: ignore[arg-type]

    def status(self) -> dict[str, object]:
        session = self._session
        return {
            "job": self._job,
            "gpu_owner": self.residency.owner,
            "load_phase": self._load_phase,
            "pipeline": session.status() if session is not None else None,
        }

    def unload(self) -> bool:
        with self._lock:
            dropped = self._drop_session()
        self.residency.release_if(lambda owner: owner == PIPELINE)
        return dropped

    def _evict_pipeline(self) -> None:
        self._drop_session()

    def _drop_session(self) -> bool:
        session, self._session = self._session, None
        self.residency.unregister(PIPELINE)
        if session is None:
            return False
        session.unload()
        self._load_phase = "idle"
        return True

    # -- training --------------------------------------------------------------

    def start_training(self, config: TrainingConfig | Mapping[str, object]) -> dict[str, object]:
        """Start a LoRA run in a child process, after every check has passed."""
        from engine.training.runner import TrainingRun

        if not isinstance(config, TrainingConfig):
            config = TrainingConfig.from_data(dict(config))
        plan = preflight_training(self.registry, config, self.hardware(verify=True))
        self._reserve("training")
        try:
            self._drop_session()
            self.residency.acquire(TRAINER)
            run = TrainingRun(plan, self.runs_dir)
            run.start()
        except BaseException:
            self.residency.release_if(lambda owner: owner == TRAINER)
            self._release_job("training")
            raise
        self._run = run
        threading.Thread(target=self._watch, args=(run,), daemon=True, name="engine-run-watch").start()
        return run.record.to_dict()

    def _watch(self, run: Any) -> None:
        while not run.poll().finished:
            time.sleep(0.2)
        self.residency.release_if(lambda owner: owner == TRAINER)
        self._release_job("training")

    def training_status(self) -> dict[str, object] | None:
        """The run's record as the watcher thread last folded it (every 0.2 s);
        only the watcher polls the child, so events are applied exactly once."""
        run = self._run
        if run is None:
            return None
        return {**run.record.to_dict(), "phase": run.phase}

    def stop_training(self, *, save: bool = True) -> dict[str, object]:
        run = self._run
        if run is None or run.record.finished:
            raise EngineError("no training run is in progress", code="not_training")
        run.stop(save=save)
        return run.record.to_dict()

    def wait_training(self, timeout: float | None = None) -> RunRecord:
        """Block until the run has finished and the watcher gave the GPU back."""
        run = self._run
        if run is None:
            raise EngineError("no training run was started", code="not_training")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not run.record.finished or self._job == "training":
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {run.record.run_id} still running after {timeout} s")
            time.sleep(0.05)
        return run.record

    def runs(self) -> list[dict[str, object]]:
        return [r.to_dict() for r in list_runs(self.runs_dir)]

    # -- jobs -----------------------------------------------------------------

    def _reserve(self, job: str) -> None:
        with self._lock:
            if self._job is not None:
                raise Busy(f"the engine is busy {self._job}; try again when it is done")
            self._job = job

    def _release_job(self, job: str) -> None:
        with self._lock:
            if self._job == job:
                self._job = None

    def register_resident(self, name: str, evict: Callable[[], None], size_gb: float = 0.0) -> Resident:
        """Register a host-owned model the engine may evict when it needs the GPU."""
        resident = Resident(name, evict, size_gb)
        self.residency.register(resident)
        return resident
