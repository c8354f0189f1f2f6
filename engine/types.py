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


def model_name(model_id: str) -> str:
    """A model's own name: the last component of a repo id or a local path.

    Rules keyed on names (pre-quantised patterns) read this and never the
    folders above it: ``/data/checkpoint4/model-dev`` is called ``model-dev``,
    and its parent's ``int4`` says nothing about the model.
    """
    parts = [part for part in model_id.replace("\\", "/").split("/") if part]
    return parts[-1] if parts else model_id


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
    #: The diffusers pipeline class this checkpoint loads as, where it is not
    #: the family's ``pipeline_class`` (an edit / Kontext pipeline).
    pipeline_class: str = ""

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
class LoraTargetShape:
    """One kind of Linear a LoRA adapts: its name suffix, shape and how many
    the full-size denoiser holds (``to_q``, 3072 -> 3072, x 57)."""

    target: str
    in_features: int
    out_features: int
    count: int

    def lora_params(self, rank: int) -> int:
        """Parameters a rank-``rank`` adapter adds over every such layer (A and B)."""
        return self.count * rank * (self.in_features + self.out_features)


@dataclass(frozen=True)
class ActivationFigures:
    """Elements a LoRA training step keeps for backward, per token.

    Measured (``bench/memory_accuracy.py --derive``) on a real-width,
    reduced-depth denoiser and carried here as data, like ``quant_factors``:
    never guessed. Multiply by the compute dtype's bytes. An *image token* is
    one 16x16-pixel patch of the training resolution (a 2x2 patch of an
    8x-downsampled latent), for every family, so one figure serves any
    resolution. *Text tokens* are the encoded prompt positions the denoiser
    attends over (``text_tokens`` of them at training time).
    """

    #: Saved per image / text token by one repeated block, no checkpointing.
    block_per_image_token: float
    block_per_text_token: float
    #: Kept per image / text token by one block under gradient checkpointing
    #: (its inputs, recomputed in backward).
    checkpointed_block_per_image_token: float
    checkpointed_block_per_text_token: float
    #: Saved per token outside the repeated blocks (embedders, final layers).
    outside_per_image_token: float
    outside_per_text_token: float
    #: Repeated blocks in the full-size denoiser.
    blocks: int
    #: Prompt positions the trainer encodes captions to.
    text_tokens: int
    #: Outside the blocks under gradient checkpointing, where it differs
    #: (a UNet: diffusers recomputes its resnets too); None: as above.
    checkpointed_outside_per_image_token: float | None = None
    checkpointed_outside_per_text_token: float | None = None


@dataclass(frozen=True)
class TrainingMemoryFigures:
    """What a family's LoRA training step holds besides its frozen weights."""

    activations: ActivationFigures
    #: Every Linear the default LoRA targets adapt, in the full-size model.
    lora_targets: tuple[LoraTargetShape, ...]


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
    #: Activation and LoRA-shape figures for the training memory estimate;
    #: None where unmeasured (the estimate then says it cannot size the run).
    training_memory: TrainingMemoryFigures | None = None
    #: Substrings of LoRA state-dict keys (diffusers, kohya, ComfyUI or
    #: ai-toolkit spellings) typical of this family; the family whose markers
    #: match the most keys is the one a foreign LoRA is said to look like.
    lora_key_markers: tuple[str, ...] = ()
    #: How the exported kohya / ComfyUI LoRA names this family's modules where
    #: the original checkpoint's layout differs from diffusers': rules of
    #: ``(kohya module, (diffusers modules...))`` with ``{i}`` for a block
    #: index; several diffusers modules are fused (rows stacked in order) into
    #: one kohya module. Modules no rule covers keep their diffusers path.
    lora_kohya_map: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: Name fragments of Linears int8 keeps dense in this family, beyond the
    #: engine's generic norm / modulation / timestep rule: layers run at
    #: M = prompt tokens (CUDA int8 matmuls need M >= 16) or at M = batch.
    int8_dense_modules: tuple[str, ...] = ()
    #: Pipeline classes whose call opens a cache context around the denoiser
    #: (First-Block-Cache needs one); None when undeclared, and the runtime
    #: reads the loaded pipeline's call instead.
    cache_context_pipelines: tuple[str, ...] | None = None
    #: Inference denials a machine capability lifts: scheme -> the
    #: ``HardwareProfile`` attribute (``fp8_activation_floor``).
    inference_deny_lifted_by: dict[str, str] = field(default_factory=dict)
    #: Steady size factors of the inference build where they differ from
    #: ``quant_factors`` (the trainer's), because ``int8_dense_modules``
    #: keeps more of the transformer dense there.
    inference_quant_factors: dict[str, float] = field(default_factory=dict)

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
        """Whether the model's own name (:func:`model_name`) says it is stored
        pre-quantised. The one test inference and training both use."""
        lowered = model_name(model_id).lower()
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

