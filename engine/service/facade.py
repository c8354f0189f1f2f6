"""``Engine``: the facade apps embed and the HTTP server serves.

Every load and every training start runs in one order:

    validate -> precision preflight -> base / model checks -> dataset decode
    -> reserve (a Busy error if another job holds the engine)
    -> acquire the GPU (evict residents) -> start

so nothing is evicted before the last cheap check passed. The rule for jobs:
one GPU job at a time. Starting a training run evicts a loaded image
pipeline (and the host's residents); loading a pipeline while a run trains
is refused with :class:`Busy` (HTTP 409), as is a second training start.
A generate is a GPU job too: while one runs, a training start, a load or an
unload is Busy, and a generate while a load or a run holds the engine is
Busy; concurrent generates queue and run one after another.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.errors import Busy, Cancelled, EngineError, UnknownName
from engine.hardware.profile import HardwareProfile
from engine.contract.plugins import Registry, load_registry
from engine.policy.available import AvailableMemory, Releasable, available_memory
from engine.policy.inference import ModelFacts, Plan, plan_inference
from engine.requests.inference import InferenceRequest
from engine.preflight.lora import read_loras
from engine.requests.loras import LoraLike, lora_choices
from engine.preflight.lora import plan_input as lora_plan_input
from engine.preflight.hub import diffusers_refusal
from engine.preflight.model import resolve_model
from engine.requests.bodies import GenerateBody
from engine.places import default_datasets_dir, default_runs_dir
from engine.requests.machine import MachineRequest
from engine.service.residency import Residency, Resident
from engine.runtime.protocol import Session, cancellable
from engine.service.catalog import CatalogQuestions
from engine.service.datasets import DatasetJobs
from engine.service.training import TRAINER, TrainingJobs

PIPELINE = "engine.pipeline"
__all__ = ["Busy", "Cancelled", "Engine", "PIPELINE", "TRAINER"]


class Engine(CatalogQuestions, TrainingJobs, DatasetJobs):
    """One engine per process. Thread-safe: jobs are reserved under a lock."""

    def __init__(
        self,
        *,
        registry: Registry | None = None,
        hardware: HardwareProfile | MachineRequest | None = None,
        runs_dir: Path | str | None = None,
        residency: Residency | None = None,
        allow_download: bool = True,
        dataset_roots: Sequence[Path | str] | None = None,
    ) -> None:
        """``allow_download``: whether a hub model missing from the local cache may
        be downloaded (many GB); False refuses it with ``download_not_allowed``
        before anything is evicted. The CLI passes the user's ``--allow-download``,
        the server its ``--allow-hub``. ``runs_dir``: where training runs are kept
        (default: $DIFFUSION_ENGINE_HOME/runs, else the per-user data folder).
        ``dataset_roots``: where the dataset methods look (default: the
        ``datasets`` folder beside the runs folder)."""
        self.allow_download = allow_download
        self.registry = registry or load_registry()
        # Engines of one process share the GPU: their arbiters hand it over (engine.service.residency).
        self.residency = residency or Residency(busy=lambda: self._job)
        #: One runs folder for every face: the CLI's ``--runs-dir`` and the server's ``--outputs`` default here.
        self.runs_dir = Path(runs_dir) if runs_dir is not None else default_runs_dir()
        self.dataset_roots = tuple(Path(r) for r in dataset_roots) if dataset_roots is not None else (
            default_datasets_dir(),
        )
        self._hardware = hardware
        self._machines: dict[bool | None, HardwareProfile] = {}
        self._lock = threading.Lock()
        #: Serialises generates (see :meth:`generate`); never held while reserving other jobs.
        self._generate_lock = threading.Lock()
        self._job: str | None = None
        self._session: Session | None = None
        self._run: Any = None
        self._watcher: threading.Thread | None = None
        #: Set by ``stop_training(now=True)``; the run's watcher ends the trainer (see :meth:`_watch`).
        self._halt = threading.Event()
        #: The run's status as last published by its watcher (see training_status).
        self._published: dict[str, object] | None = None
        self._load_phase = "idle"
        #: The running generate's cancel event (see :meth:`cancel_generation`).
        self._generation_cancel: threading.Event | None = None

    # -- machine --------------------------------------------------------------

    def hardware(self, *, verify: bool | None = None) -> HardwareProfile:
        """The machine decisions are made for: the one given, else a probe.

        A :class:`~engine.requests.MachineRequest` given at construction (a preset,
        or this machine with overrides) is resolved here, when first needed, so
        building an engine probes nothing and a refusal before that stays cheap."""
        if isinstance(self._hardware, MachineRequest):
            if verify not in self._machines:  # one answer per kind of probe for this engine's life
                self._machines[verify] = self._hardware.profile(verify=verify)
            return self._machines[verify]
        if self._hardware is not None:
            return self._hardware
        from engine.hardware.probe import probe

        return probe(verify=verify)

    def available_memory(self, *, verify: bool | None = None) -> AvailableMemory:
        """The memory a new job would have: free now plus what evicting the
        engine's pipeline and every registered resident would release.

        Measured before anything is evicted, so a doomed request is still
        refused with every resident in place."""
        releasable = [
            Releasable(r.name, r.size_gb, "declared by the host")
            for r in self.residency.residents() if r.name not in (PIPELINE, TRAINER)
        ]
        session = self._session
        if session is not None:
            releasable.append(Releasable(PIPELINE, _held_gb(session.plan), "the engine's loaded pipeline (its plan)"))
        return available_memory(self.hardware(verify=verify), releasable)

    # -- light questions ------------------------------------------------------------

    def plan(
        self,
        model: str | None = None,
        *,
        family: str | None = None,
        checkpoint: str | None = None,
        base: str | None = None,
        request: InferenceRequest = InferenceRequest(),
        controlnet: str | None = None,
    ) -> Plan:
        """The plan a load would make (``controlnet``: a ControlNet folder
        loaded beside ``model``, sized in like any component)."""
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
        if controlnet is not None:
            from engine.preflight.controlnet import check_controlnet, with_controlnet

            facts = with_controlnet(facts, check_controlnet(facts.family, controlnet))
        return plan_inference(
            self.registry, facts, self.hardware(), request, available=self.available_memory()
        )

    # -- images -----------------------------------------------------------------

    def prepare_runtime(self) -> float:
        """Import the runtime stack (torch, diffusers, transformers, peft) now; seconds it took
        (0 when already imported), so a face can report start-up apart from loading."""
        import importlib
        import sys
        import time

        started = time.perf_counter()
        if "engine.runtime.session" not in sys.modules:
            importlib.import_module("engine.runtime.session")
        return time.perf_counter() - started

    def load(
        self,
        model: str,
        *,
        base: str | None = None,
        family: str | None = None,
        request: InferenceRequest = InferenceRequest(),
        loras: Sequence[LoraLike] = (),
        switching: bool = False,
        controlnet: str | None = None,
    ) -> dict[str, object]:
        """Load a pipeline; every check runs before anything is evicted.

        ``controlnet``: a diffusers ControlNet folder of a class the family
        declares, loaded beside the pipeline for ``control_image`` generates.

        ``loras`` (``PATH[:SCALE]`` strings, ``{"path", "scale"}`` mappings or
        :class:`~engine.preflight.lora.LoraChoice`) are applied at load; each
        is checked against the model's module tree first, so a LoRA for
        another model is refused with every resident in place. ``switching``
        says LoRAs will be changed later (they then stay unfused)."""
        from engine.runtime.engines import start_session

        source, lora_files, controlnet, request, plan, refusal = self._load_preflight(
            model, base=base, family=family, request=request, loras=loras, switching=switching,
            controlnet=controlnet, verify=True,
        )
        self._reserve("loading")
        try:
            self._load_phase = "evicting"
            self._drop_session()
            self.residency.acquire(PIPELINE)
            self._load_phase = "loading"
            session = start_session(self.registry, source, plan, request, loras=lora_files, controlnet=controlnet,
                                    diffusers_refusal=refusal)
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

    def check_load(
        self,
        model: str,
        *,
        base: str | None = None,
        family: str | None = None,
        request: InferenceRequest = InferenceRequest(),
        loras: Sequence[LoraLike] = (),
        switching: bool = False,
        controlnet: str | None = None,
    ) -> Plan:
        """Every check :meth:`load` makes, loading nothing: the plan it would load with,
        or the refusal it would give (a single file without its base, an uncached hub
        model without consent, a LoRA that is missing or for another model...)."""
        return self._load_preflight(model, base=base, family=family, request=request, loras=loras,
                                    switching=switching, controlnet=controlnet, verify=False)[4]

    def _load_preflight(
        self, model: str, *, base: str | None, family: str | None, request: InferenceRequest,
        loras: Sequence[LoraLike], switching: bool, controlnet: str | None, verify: bool,
    ) -> tuple[Any, Any, Any, InferenceRequest, Plan, EngineError | None]:
        """The load's checks, cheapest first: nothing is imported that a refusal does not need.
        Last: why diffusers could not take the model (an sd.cpp load's fallback), or None."""
        from engine.preflight.controlnet import check_controlnet, with_controlnet

        source = resolve_model(self.registry, model, family=family, base=base)
        refusal = diffusers_refusal(source, base_given=base is not None, allow_download=self.allow_download)
        if refusal is not None and source.kind not in source.family.sdcpp.kinds:
            raise refusal  # no sd.cpp path could take this model instead: refused first
        lora_files = read_loras(lora_choices(loras))
        if controlnet is not None:
            controlnet = check_controlnet(source.family, controlnet)
        if lora_files:
            from engine.runtime.lora import check_loras

            check_loras(self.registry, source, lora_files)
        request = dataclasses.replace(request, loras=lora_plan_input(lora_files, switching=switching))
        plan = plan_inference(
            self.registry, with_controlnet(source.facts(self.registry), controlnet),
            self.hardware(verify=verify or None), request,
            available=self.available_memory(verify=verify or None),
        )
        if plan.value("engine") != "sdcpp":  # sd.cpp reads the files beside the model: no base, no hub
            if refusal is not None:
                raise refusal
            if verify:
                from engine.runtime.loading import check_weightless_components

                check_weightless_components(source)  # a processor missing a library fails here, not mid-load
        return source, lora_files, controlnet, request, plan, refusal

    def generate(
        self,
        prompt: str | GenerateBody,
        *,
        progress: Callable[[int, int], None] | None = None,
        loras: Sequence[LoraLike] | None = None,
        cancel: threading.Event | None = None,
        **options: object,
    ) -> list[Any]:
        """Images for a :class:`~engine.requests.GenerateBody` (the request every face
        builds), or for a ``prompt`` string with keyword options (steps, guidance,
        width, height, seed, count, negative_prompt...); ``progress(step, total)``
        after each step.

        ``loras`` (as for :meth:`load`) replaces the loaded pipeline's LoRAs
        or their scales for this and later calls without reloading the base
        (``[]`` removes them; None keeps them).

        A generate is a GPU job: it holds the ``generating`` reservation for
        its whole duration, so a training start or a load meanwhile is
        :class:`Busy`, and a generate while one of those holds the engine is
        Busy too. Concurrent generates are serialised (they queue on a lock,
        one pipeline call at a time) rather than refused, so several clients
        of one loaded pipeline all get their images.

        ``cancel``, set from any thread (a server whose client went away),
        stops the call with :class:`Cancelled` before it starts or after the
        step that is running, and frees the engine for the next job;
        :meth:`cancel_generation` sets it for the running call.

        Image inputs (see :class:`~engine.runtime.session.GenerateRequest`):
        ``image`` (img2img, or an edit on an edit checkpoint) with
        ``strength``, ``mask_image`` (inpaint); batches: ``prompts`` and
        ``seeds`` lists (image k replays alone with its seed), ``batch``
        (images per forward)."""
        from engine.runtime.engines import fall_back_from
        from engine.runtime.sdcpp import SdcppFailed
        from engine.runtime.session import GenerateRequest

        if isinstance(prompt, GenerateBody):  # the typed request: its options and LoRAs
            options = {**prompt.options(), **options}
            if loras is None and prompt.loras is not None:
                loras = [{"path": lo.path, "scale": lo.scale} for lo in prompt.loras]
            prompt = prompt.prompt
        cancel = cancel or threading.Event()
        progress = cancellable(progress, cancel)
        for name in ("prompts", "seeds"):
            if name in options:  # a request model's list (or None: unset)
                options[name] = tuple(options[name] or ())  # type: ignore[call-overload]

        with self._generate_lock:
            self._reserve("generating")
            self._generation_cancel = cancel
            try:
                session = self._session
                if session is None:
                    raise EngineError("no image pipeline is loaded; load one first", code="not_loaded")
                files = None if loras is None else read_loras(lora_choices(loras))
                if cancel.is_set():
                    raise Cancelled("the generate was cancelled before it started")
                call = GenerateRequest(prompt=prompt, loras=files, **options)  # type: ignore[arg-type]
                try:
                    return session.generate(call, progress, cancel)
                except SdcppFailed as exc:  # the CPU engine failed: diffusers takes the model over
                    self._session = fall_back_from(session, exc)
                    return self._session.generate(call, progress, cancel)
            finally:
                self._generation_cancel = None
                self._release_job("generating")

    def cancel_generation(self) -> bool:
        """Stop the running generate after its current denoising step (it
        raises :class:`Cancelled` to its caller); False when none runs.
        Generates queued behind it still run."""
        cancel = self._generation_cancel
        if cancel is None:
            return False
        cancel.set()
        return True

    def loaded_plan(self) -> Plan | None:
        """The loaded pipeline's plan as the runtime recorded it (a kernel or
        quantised build that fell back included), or None when none is loaded."""
        session = self._session
        return session.plan if session is not None else None

    def status(self) -> dict[str, object]:
        session = self._session
        return {
            "job": self._job,
            "gpu_owner": self.residency.owner,
            "load_phase": self._load_phase,
            "pipeline": session.status() if session is not None else None,
        }

    def unload(self, *, cancel: bool = False) -> bool:
        """Release the loaded pipeline. A running generate is not pulled from
        under: this waits for it to finish (``cancel``: stops it at its next
        step first); a load in progress is :class:`Busy`."""
        with self._lock:
            if self._job == "loading":
                raise Busy("the engine is busy loading; unload when it is done")
        if cancel:
            self.cancel_generation()
        with self._generate_lock:  # held by a running generate: wait for it
            with self._lock:
                if self._job == "loading":
                    raise Busy("the engine is busy loading; unload when it is done")
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
        _check_host_name(name)
        resident = Resident(name, evict, size_gb)
        self.residency.register(resident)
        return resident

    def unregister_resident(self, name: str) -> bool:
        """Forget a host-owned model (the host freed it itself); True when it was registered."""
        _check_host_name(name)
        return self.residency.unregister(name)


def _check_host_name(name: str) -> None:
    if name in (PIPELINE, TRAINER):
        raise EngineError(
            f"{name!r} is the engine's own job name; register host models under another name",
            code="invalid_request",
        )


def _held_gb(plan: Plan) -> float:
    """Device GB a loaded pipeline holds between calls: its weights when
    resident (or when the device is the host), little when offloaded; sd.cpp's files as stored."""
    if plan.sdcpp is not None:
        return plan.sdcpp.gb
    if plan.value("memory_mode") == "resident" or plan.device == "cpu":
        return plan.estimate.resident_gb
    return 0.0
