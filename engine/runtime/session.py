"""One loaded pipeline: load it as the plan says, generate, report, unload.

:class:`InferenceSession` is the object the engine holds while a model is
loaded. It keeps the state and the lifecycle (load, LoRAs, status, unload) and
takes its three jobs from one mixin each, so each reads on its own:

- :mod:`engine.runtime.loading`: build the pipeline and place it per the plan,
  loading the plan's fallback (with the reason recorded) when a quantised build
  or a placement fails;
- :mod:`engine.runtime.speedups`: the attention backend, regional compile and
  step cache, re-decided for the actual step count of every generate call;
- :mod:`engine.runtime.generation`: a :class:`GenerateRequest` run through its
  workflow's pipeline in chunks.

The plan's provenance follows what really happened, and ``status()`` reports
the record.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import EngineError
from engine.contract.plugins import Registry
from engine.policy.compatibility import plan_refusals
from engine.policy.plan import Plan
from engine.requests.inference import InferenceRequest
from engine.preflight.lora import LoraFile
from engine.preflight.source import ModelSource
from engine.runtime import capabilities, flags, heap, text_encoders, workflows
from engine.runtime.attention import Installer, pip_install_wheel
from engine.runtime.generation import GenerateRequest, Generation
from engine.runtime.loading import TORCH_DTYPES, LoadFailed, PipelineLoading, Progress, resident
from engine.runtime.lora import HookAdapters, LoraSet
from engine.runtime.lora_check import check_on_pipeline
from engine.runtime.quantize import Placement
from engine.runtime.speedups import SpeedControls

#: The names callers import from here (the request and errors live beside their code).
__all__ = ["TORCH_DTYPES", "GenerateRequest", "InferenceSession", "LoadFailed", "Progress"]


class InferenceSession(PipelineLoading, SpeedControls, Generation):
    """A pipeline loaded per a :class:`Plan`. Not thread-safe for concurrent
    generates on one session: calls are serialised by a lock."""

    def __init__(
        self,
        registry: Registry,
        source: ModelSource,
        plan: Plan,
        request: InferenceRequest = InferenceRequest(),
        *,
        installer: Installer = pip_install_wheel,
        compile_backend: str = "inductor",
        loras: Sequence[LoraFile] = (),
        controlnet: str | None = None,
    ) -> None:
        self.registry = registry
        #: The ControlNet folder to load beside the pipeline, and the loaded model.
        self.controlnet_path = controlnet
        self._controlnet: Any = None
        self.source = source
        self.plan = plan
        self.request = request
        #: The numeric canary of the scheme loaded (see :mod:`engine.runtime.canary`), if one ran.
        self.canary: dict[str, object] | None = None
        self._installer = installer
        self._compile_backend = compile_backend
        self._pipe: Any = None
        self._flags: flags.FlagSnapshot | None = None
        self._cache_kind = "off"
        self._lock = threading.Lock()
        self.quantised_layers = 0
        self.onednn_layers = 0  # fp32 Linears routed through oneDNN (the plan's cpu_kernel)
        #: Streams the text encoders per call (``text_encoder_memory=streamed``).
        self.encoder_stream: text_encoders.EncoderStream | None = None
        self.encoder_placements: list[Placement] = []
        #: Whether the last call's VAE decoded in tiles.
        self.vae_tiled = False
        #: How the quantised transformer was placed, when one was.
        self.placement: Placement | None = None
        #: Why the planned fallback was loaded instead of the plan, if it was.
        self.fallback: dict[str, object] | None = None
        self._initial_loras = tuple(loras)
        #: The LoRAs applied to the pipeline (see :mod:`engine.runtime.lora`).
        self.loras: LoraSet | None = None
        #: Workflow pipelines built over the loaded components, by class name.
        self._workflow_pipes: dict[str, Any] = {}
        #: The pipeline the running generate calls (a workflow's), for the step cache.
        self._active: Any = None
        #: Out-of-memory splits of batch chunks since load (latest last).
        self.batch_events: list[dict[str, object]] = []
        #: What the loaded classes support, checked at load (declared vs verified).
        self.capabilities: dict[str, capabilities.CapabilityCheck] | None = None

    # -- load -------------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        if self._pipe is None:
            raise EngineError("no model is loaded", code="not_loaded")
        return self._pipe

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.source.family.pipeline.denoiser)

    @property
    def denoisers(self) -> list[torch.nn.Module]:
        """The denoiser and every expert beside it (see ``PipelineLayout.experts``)."""
        from engine.runtime.loading import denoisers_of

        return denoisers_of(self.pipeline, self.source.family)

    def load(self, progress: Progress | None = None) -> None:
        """Load and place the pipeline per the plan, then apply attention,
        LoRAs, compile and the step cache; on any failure, release it all."""
        refused = plan_refusals(self.plan)
        if refused:  # a hand-built or stale plan: refuse before touching the device
            raise EngineError(
                f"this plan combines options that do not work together: {'; '.join(refused)}",
                code="incompatible_plan",
            )
        self._flags = flags.snapshot()
        heap.settle()  # before the first build: the libraries' objects out of every unload's collection
        try:
            self._apply_process_flags()
            self._pipe = self._build(self.plan, progress)
            family = self.source.family
            if self.controlnet_path:
                self._controlnet = workflows.load_controlnet(
                    family, self.controlnet_path, TORCH_DTYPES[str(self.plan.value("dtype"))],
                    self.plan.device if resident(self.plan) else "cpu",
                )
            self.capabilities = capabilities.verify(family, self._pipe, self.registry.compile_regions(family))
            self.plan = capabilities.adapt_plan(self.plan, self.capabilities)
            self._apply_attention()
            self._apply_loras()
            self._apply_fusions()
            self._apply_text_kv()
            self._apply_compile()
            self._set_step_cache(str(self.plan["step_cache"].value))
        except BaseException:
            self.unload()
            raise

    # -- status and unload ----------------------------------------------------

    def status(self) -> dict[str, object]:
        return {
            "loaded": self._pipe is not None,
            "model": self.source.to_dict(),
            "plan": self.plan.to_dict(),
            "step_cache_engaged": self._cache_kind != "off",
            "quantised_layers": self.quantised_layers,
            "onednn_layers": self.onednn_layers,
            "text_encoders": {
                "placements": [p.to_dict() for p in self.encoder_placements],
                "stream": self.encoder_stream.status() if self.encoder_stream else None,
                "vae_tiled_last_call": self.vae_tiled,
            },
            "placement": self.placement.to_dict() if self.placement else None,
            "fallback": self.fallback,
            "canary": self.canary,
            "loras": self.loras.status() if self.loras is not None else None,
            "workflows": sorted({"txt2img", *self.source.family.workflows_of(self.source.checkpoint)}),
            "controlnet": self.controlnet_path,
            "batch_events": list(self.batch_events),
            "capabilities": capabilities.to_dict(self.capabilities) if self.capabilities else None,
            "compile_cache": self.compile_cache_status(),
            "eager_fusions": self.fusions.to_dict() if self.fusions is not None else None,
            "text_kv_cache": self.text_kv.to_dict() if self.text_kv is not None else None,
        }

    # -- LoRAs ------------------------------------------------------------------

    def _apply_loras(self) -> None:
        """Apply the LoRAs given at construction as the plan's ``lora`` control
        says (before compile, so hot-swap slots are declared first)."""
        mode = str(self.plan.value("lora", "unfused"))
        ranks = self.request.loras.max_rank or max((f.rank for f in self._initial_loras), default=0)
        hooks = None
        if self.capabilities is not None and not self.capabilities["pipeline_lora"].verified:
            hooks = HookAdapters(self.registry, self.source.family, self._pipe)
        self.loras = LoraSet(self._pipe, "unfused" if mode == "none" else mode, ranks, hooks,
                             family=self.source.family)
        self.loras.prepare_hotswap()
        if self._initial_loras:
            self.loras.apply(check_on_pipeline(self.registry, self.source.family, self._pipe, self._initial_loras))

    def set_loras(self, files: Sequence[LoraFile]) -> None:
        """Switch the LoRAs or their scales on the loaded pipeline (the base is
        not reloaded); every file is checked before anything changes."""
        if self.loras is None:
            raise EngineError("no model is loaded", code="not_loaded")
        files = tuple(files)
        if files != self.loras.applied:
            self.loras.apply(check_on_pipeline(self.registry, self.source.family, self.pipeline, files))

    def unload(self) -> None:
        """Release the pipeline and memory, and restore every torch flag."""
        self._pipe = None
        self.encoder_stream = None
        self._workflow_pipes.clear()
        self._controlnet = None
        self.loras = None
        self._cache_kind = "off"
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._flags is not None:
            self._flags.restore()
            self._flags = None
