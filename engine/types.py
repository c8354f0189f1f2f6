"""Plain data the plugin contract speaks in.

A family plugin describes its model family with a :class:`FamilySpec`: a data
sheet a reviewer can check line by line against published figures. Everything
here is a frozen dataclass of builtins, so a table module imports nothing heavy
and a spec can be hashed, compared and printed.

Sizes are decimal gigabytes (1 GB = 10**9 bytes), the unit model cards use.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Literal

Purpose = Literal["inference", "training"]
PURPOSES: tuple[Purpose, ...] = ("inference", "training")

#: Transformer weight schemes the engine knows how to plan for.
QUANT_SCHEMES: tuple[str, ...] = ("bf16", "int8", "fp8", "mxfp8", "nvfp4", "nf4")

#: Base precisions a DiT LoRA trainer can hold its frozen base in.
TRAINING_PRECISIONS: tuple[str, ...] = ("nf4", "bf16", "int8", "fp8", "mxfp8", "auto")

Architecture = Literal["dit", "unet"]


@dataclass(frozen=True)
class ComponentSizes:
    """bf16 bytes of a pipeline's parts, in GB."""

    transformer_gb: float
    text_encoders_gb: float
    vae_gb: float

    @property
    def total_gb(self) -> float:
        return self.transformer_gb + self.text_encoders_gb + self.vae_gb


@dataclass(frozen=True)
class QuantDeny:
    """A scheme a family must not use for a purpose, and the measured reason."""

    scheme: str
    reason: str


@dataclass(frozen=True)
class OptimizationDeny:
    """A speed optimisation a family must not get, and the measured reason.

    ``optimization`` is one of ``fp16_accumulation``, ``step_cache``,
    ``compile``, or an attention backend (``sage``, ``flash``, ``flash3``,
    ``xformers``).
    """

    optimization: str
    reason: str


@dataclass(frozen=True)
class Checkpoint:
    """One published checkpoint of a family, with its sampling defaults.

    ``matches`` are case-insensitive glob patterns over repo ids and folder
    names (``*model-v2-turbo*``); the first checkpoint whose pattern matches
    a model id is the one the engine assumes. ``sizes`` overrides the family's
    sizes for checkpoints of another size.
    """

    name: str
    label: str
    repo: str
    default_steps: int
    default_guidance: float
    matches: tuple[str, ...] = ()
    sizes: ComponentSizes | None = None

    def match_score(self, model_id: str) -> int:
        """Length of the longest pattern matching ``model_id`` (0: no match).

        The most specific pattern wins, so ``Model-Edit`` is not taken for
        ``Model`` when both patterns match.
        """
        lowered = model_id.lower()
        return max(
            (len(p) for p in self.matches if fnmatch.fnmatch(lowered, p.lower())), default=0
        )


Prediction = Literal["flow_matching", "epsilon", "v_prediction"]


@dataclass(frozen=True)
class TrainingObjective:
    """What one generic LoRA trainer loop needs to know about a family.

    ``runtime_module`` names the family's torch module holding the functions
    the loop calls (prompt encoding, latent encoding and packing, the model
    call); it is imported only when a run starts.
    """

    prediction: Prediction
    timestep_sampling: Literal["logit_normal", "uniform", "shifted_sigmoid"]
    runtime_module: str


@dataclass(frozen=True)
class FamilySpec:
    """Everything the engine may know about a model family without torch.

    Registered through ``engine_register_families``. The per-concern hooks
    (sizes, deny lists, dense base, training modes, compile regions) are
    answered from these fields by the engine's built-in table plugin unless a
    plugin answers them first.
    """

    name: str
    label: str
    architecture: Architecture
    pipeline_class: str
    #: ``model_index.json`` ``_class_name`` values that identify this family.
    pipeline_class_names: tuple[str, ...]
    checkpoints: tuple[Checkpoint, ...]
    sizes: ComponentSizes
    #: bf16 GB of the denoiser a LoRA trainer holds dense.
    training_dense_gb: float
    lora_targets: tuple[str, ...]
    #: Class names of the repeated blocks that regional compile targets.
    compile_regions: tuple[str, ...]
    #: False where fp16 compute renders black or fails; the reason says which.
    fp16_compute_safe: bool
    #: Whether the trainer honours ``base_precision`` (DiT yes, UNet no).
    base_precision_applies: bool
    #: Whether the trainer computes in bf16 whatever the base precision.
    training_requires_bf16: bool
    #: Dotted path of the module with this family's torch code.
    runtime_module: str
    aliases: tuple[str, ...] = ()
    fp16_unsafe_reason: str = ""
    quant_deny: dict[Purpose, tuple[QuantDeny, ...]] = field(default_factory=dict)
    #: Glob patterns naming a pre-quantised repo (``*bnb-4bit*``).
    prequantised_patterns: tuple[str, ...] = ()
    #: The dense base to use when a pre-quantised repo matches no checkpoint.
    default_dense_base: str = ""
    #: ``"module:function"`` writing a tiny random-weight pipeline to a folder.
    tiny_pipeline: str = ""
    #: The pipeline component that denoises (``transformer`` or ``unet``).
    denoiser: str = "transformer"
    #: The pipeline call's guidance argument (``true_cfg_scale`` for real CFG).
    guidance_kwarg: str = "guidance_scale"
    #: Substrings of state-dict keys that identify this family's denoiser in a
    #: single-file checkpoint (diffusers or original key names).
    single_file_markers: tuple[str, ...] = ()
    optimization_deny: tuple[OptimizationDeny, ...] = ()
    #: Steady size factors per scheme for this family's transformer, where
    #: they differ from the generic ones (its layer mix, under the filter).
    quant_factors: dict[str, float] = field(default_factory=dict)
    training_objective: TrainingObjective | None = None

    def __hash__(self) -> int:  # dict fields make the default hash fail
        return hash((self.name, self.pipeline_class))

    @property
    def default_checkpoint(self) -> Checkpoint:
        return self.checkpoints[0]

    def checkpoint(self, name: str) -> Checkpoint | None:
        """The checkpoint called ``name``, or the one whose patterns match it."""
        lowered = name.lower()
        for checkpoint in self.checkpoints:
            if lowered in (checkpoint.name.lower(), checkpoint.repo.lower()):
                return checkpoint
        best = max(self.checkpoints, key=lambda c: c.match_score(name))
        return best if best.match_score(name) else None

    def is_prequantised(self, model_id: str) -> bool:
        lowered = model_id.lower()
        return any(fnmatch.fnmatch(lowered, p.lower()) for p in self.prequantised_patterns)

    def matches_id(self, model_id: str) -> bool:
        return any(c.match_score(model_id) for c in self.checkpoints)


@dataclass(frozen=True)
class PluginLoadError:
    """A plugin that could not be loaded, reported instead of raised."""

    plugin: str
    package: str
    error: str


@dataclass(frozen=True)
class PluginInfo:
    """What ``diffusion-engine families`` shows about one loaded plugin."""

    name: str
    package: str
    version: str
    hooks: tuple[str, ...]
    families: tuple[str, ...]
    builtin: bool = False

