"""The plan's records: what was asked, what is known of the model, what was decided.

Torch-free. :class:`InferenceRequest` is the user's request (``auto`` leaves a
control to the engine; it is the request vocabulary's, :mod:`engine.requests.inference`),
:class:`ModelFacts` what the planner knows of the
model without loading it, and :class:`Plan` the result: every control
resolved with its reason, keyed by the names UIs and the HTTP API use
(:data:`CONTROLS`). The decisions themselves are made in
:func:`engine.policy.inference.plan_inference`; the runtime re-decides single
controls on a plan with :meth:`Plan.with_control`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engine.policy.available import AvailableMemory
from engine.policy.encoders import PrecastEncoders
from engine.policy.memory import MemoryEstimate
from engine.policy.resolved import Resolved
from engine.policy.runtime_engine import SdcppFiles
from engine.requests.inference import InferenceRequest, LoraPlanInput
from engine.contract.types import Checkpoint, ComponentSizes, FamilySpec

#: The controls of a plan, in display order; these names are the JSON keys.
CONTROLS: tuple[str, ...] = (
    "engine",
    "dtype",
    "transformer_quant",
    "text_encoder_dtype",
    "vae_dtype",
    "text_encoder_quant",
    "text_encoder_memory",
    "memory_mode",
    "attention_backend",
    "step_cache",
    "compile",
    "speed_tier",
    "fp16_accumulation",
    "threads",
    "parallel",
    "cpu_kernel",
    "lora",
    "tf32",
    "vae_tiling",
    "vae_slicing",
    "eager_fusions",
)


@dataclass(frozen=True)
class ModelDefaults:
    """A model folder's own defaults where the family's table does not fit it (a tiny
    random-weight pipeline is 64 px and 4 steps, not its family's 1024 px and 28), read
    from the folder's ``diffusion_engine.json``; None: the table's."""

    width: int | None = None
    height: int | None = None
    steps: int | None = None
    #: A video model's own clip length (a tiny pipeline's few frames, not its checkpoint's 121).
    frames: int | None = None


@dataclass(frozen=True)
class ModelFacts:
    """What the planner knows about the model to load, without loading it."""

    family: FamilySpec
    checkpoint: Checkpoint | None
    table_sizes: ComponentSizes
    #: Sizes read from the checkpoint's own files, when it is local.
    measured_sizes: ComponentSizes | None = None
    #: The denoiser's steady GB per scheme, sized from its tensor shapes.
    measured_scheme_gb: Mapping[str, float] | None = None
    #: Size of a GGUF transformer file given instead of the dense one, GB.
    gguf_transformer_gb: float | None = None
    #: The transformer is stored pre-quantised in this scheme (``nf4``).
    prequantised_scheme: str | None = None
    #: The text encoders are stored pre-cast (an fp8 T5), from their headers.
    precast_encoders: PrecastEncoders | None = None
    #: bf16 GB of a ControlNet loaded beside the model (its headers; 0: none).
    controlnet_gb: float = 0.0
    #: What stable-diffusion.cpp would read for this model, or why it cannot.
    sdcpp: SdcppFiles = SdcppFiles(refusal="no model file was given")
    #: The folder's own size and steps where a request is silent (:class:`ModelDefaults`).
    defaults: ModelDefaults = ModelDefaults()
    #: A single file its publisher stored quantised (``fp8_scaled``), from its header.
    stored_format: str | None = None
    #: The denoiser's attention heads from a folder's config (None: the checkpoint's table, or unknown).
    attention_heads: int | None = None

    @property
    def sizes(self) -> ComponentSizes:
        return self.measured_sizes or self.table_sizes


@dataclass(frozen=True)
class Plan:
    """Every control of one load resolved with its reason, the memory estimate
    it was made from, and the fallback to build if the quantised one fails."""

    family: str
    checkpoint: str | None
    device: str
    controls: Mapping[str, Resolved[Any]]
    estimate: MemoryEstimate
    step_cache_threshold: float
    compile_fullgraph: bool
    #: A pip package to try installing for the attention backend, or None.
    attention_install: str | None
    default_steps: int
    fallback: Plan | None = None
    #: The steps and guidance a few-step LoRA sets where the request says none, with why.
    lora_sampling: Any = None
    #: The LoRAs' adapted modules, matched and skipped (a ``LoraModules``); None: no LoRA.
    lora_modules: Any = None
    #: (width, height) where a request gives none and the model has its own (None: the pipeline's).
    default_size: tuple[int, int] | None = None
    sizes: Mapping[str, ComponentSizes] = field(default_factory=dict)
    #: The memory the plan was made for (free after eviction, with sources).
    available: AvailableMemory | None = None
    #: The image (1-based) of a session before which regional compile runs
    #: (1: at load; a dense auto compile waits, so a one-off image is not slowed).
    compile_from_image: int = 1
    #: The transformer is a GGUF file (``transformer_quant`` None: not re-quantised).
    gguf: bool = False
    #: An auto step cache may engage at some generate of the session.
    step_cache_may_engage: bool = False
    #: How messages name this family's denoiser ("transformer", "UNet").
    denoiser_label: str = "transformer"
    #: The files sd.cpp reads and their RAM, when the ``engine`` control is ``sdcpp``
    #: (its memory figures come from the files, not the torch estimate).
    sdcpp: SdcppFiles | None = None
    #: The torch path fits this machine (False: an sd.cpp plan with no diffusers fallback).
    diffusers_fits: bool = True
    #: How the request splits across ranks (a ``ParallelChoice``); None: one process.
    parallel: Any = None

    def __getitem__(self, control: str) -> Resolved[Any]:
        return self.controls[control]

    def value(self, control: str, default: object = None) -> object:
        """The decided value of ``control``; ``default`` where this plan has no such control
        (a plan made before the control existed, or by a family without it)."""
        resolved = self.controls.get(control)
        return default if resolved is None else resolved.value

    def with_control(self, control: str, resolved: Resolved[Any]) -> Plan:
        """A copy with one control re-decided (at load or generate time); it
        keeps what was requested unless ``resolved`` says."""
        controls = dict(self.controls)
        if resolved.requested is None and control in controls:
            resolved = resolved.with_request(controls[control].asked)
        controls[control] = resolved
        return dataclasses.replace(self, controls=MappingProxyType(controls))

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.family,
            "checkpoint": self.checkpoint,
            "device": self.device,
            "resolved": {name: self.controls[name].to_dict() for name in CONTROLS if name in self.controls},
            "estimate": self.estimate.to_dict(),
            "step_cache_threshold": self.step_cache_threshold,
            "compile_fullgraph": self.compile_fullgraph,
            "compile_from_image": self.compile_from_image,
            "attention_install": self.attention_install,
            "sizes": {k: dataclasses.asdict(v) for k, v in self.sizes.items()},
            "fallback": self.fallback.to_dict() if self.fallback else None,
            "lora_sampling": self.lora_sampling.to_dict() if self.lora_sampling is not None else None,
            "lora_modules": self.lora_modules.to_dict() if self.lora_modules is not None else None,
            "sdcpp": self.sdcpp.to_dict() if self.sdcpp else None,
            "available_memory": self.available.to_dict() if self.available else None,
            "parallel": self.parallel.to_dict() if self.parallel is not None else None,
        }


def requested_by_control(request: InferenceRequest) -> dict[str, object]:
    """What the user asked of each control (``auto`` where they left it)."""
    return {
        "engine": request.engine,
        "dtype": request.dtype,
        "transformer_quant": request.quant,
        "text_encoder_dtype": request.dtype,
        "vae_dtype": request.dtype,
        "memory_mode": request.memory,
        "attention_backend": request.attention,
        "step_cache": request.step_cache,
        "compile": request.compile,
        "speed_tier": "auto" if request.speed == "default" else request.speed,
        "threads": "auto" if request.threads is None else request.threads,
        "parallel": request.parallel,
        "text_encoder_quant": request.text_encoder_quant,
        "text_encoder_memory": request.text_encoder_memory,
        "vae_tiling": request.vae_tiling,
    }
