"""Plain data the plugin contract speaks in.

A family plugin describes its model family with a :class:`FamilySpec`: a data
sheet a reviewer can check line by line against published figures. Everything
here is a frozen dataclass of builtins, so a table module imports nothing heavy
and a spec can be hashed, compared and printed.

Sizes are decimal gigabytes (1 GB = 10**9 bytes), the unit model cards use.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Literal

Purpose = Literal["inference", "training"]
PURPOSES: tuple[Purpose, ...] = ("inference", "training")

#: Transformer weight schemes the engine knows how to plan for, and the base precisions a
#: DiT LoRA trainer can hold its frozen base in: from the scheme table (engine.contract.schemes).
from engine.contract.schemes import QUANT_SCHEMES as QUANT_SCHEMES  # noqa: E402  (re-exported)
from engine.contract.schemes import TRAINING_PRECISIONS as TRAINING_PRECISIONS  # noqa: E402

Architecture = Literal["dit", "unet"]

#: What a generate does with its inputs: draw from text (``txt2img``), redraw
#: an image (``img2img``, with a strength), redraw the masked part of it
#: (``inpaint``), follow an instruction about it (``edit``), or draw from
#: text guided by a control map through a loaded ControlNet (``controlnet``).
#: A video family draws from text the same way (``txt2img`` is its text-to-video) and
#: animates an image (``img2vid``).
Workflow = Literal["txt2img", "img2img", "inpaint", "edit", "controlnet", "img2vid"]
WORKFLOWS: tuple[Workflow, ...] = ("txt2img", "img2img", "inpaint", "edit", "controlnet", "img2vid")


@dataclass(frozen=True)
class ComponentSizes:
    """bf16 bytes of a pipeline's parts, in GB."""

    transformer_gb: float
    text_encoders_gb: float
    vae_gb: float
    #: Where the figures come from, where a plan should say it (plugin API 2, additive): a
    #: model whose sizes are not published is sized from its configs ("" : the family's table).
    source: str = ""

    @property
    def total_gb(self) -> float:
        return self.transformer_gb + self.text_encoders_gb + self.vae_gb


@dataclass(frozen=True)
class QuantDeny:
    """A scheme a family must not use for a purpose, and the measured reason."""

    scheme: str
    reason: str


#: The attention kernels beyond torch's SDPA, by the names requests and deny
#: lists use (``--attention``, ``OptimizationDeny``).
ATTENTION_KERNELS: tuple[str, ...] = ("cudnn", "flash", "flash3", "flash4", "sage", "xformers")
#: What an ``OptimizationDeny`` may name.
OPTIMIZATIONS: tuple[str, ...] = ("fp16_accumulation", "step_cache", "compile", *ATTENTION_KERNELS)


@dataclass(frozen=True)
class OptimizationDeny:
    """A speed optimisation a family must not get, and the measured reason.

    ``optimization`` is one of :data:`OPTIMIZATIONS`: ``fp16_accumulation``,
    ``step_cache``, ``compile``, or an attention kernel (:data:`ATTENTION_KERNELS`).
    """

    optimization: str
    reason: str


from engine.contract.names import model_name as model_name, name_has_marker as name_has_marker  # noqa: E402,I001


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
    #: The image workflows this checkpoint serves and the diffusers pipeline
    #: class that serves each, where they differ from the family's
    #: ``workflows`` (an edit checkpoint: ``(("edit", "...EditPipeline"),)``).
    workflows: tuple[tuple[Workflow, str], ...] | None = None
    #: A video checkpoint's own lattice, fps and sizes where they differ from the family's.
    video: VideoSpec | None = None
    #: Its own latent geometry where its VAE differs from the family's (a variant with a deeper VAE).
    geometry: LatentGeometry | None = None
    #: A two-expert checkpoint's guidance for its low-noise expert (the pipeline's
    #: ``guidance_scale_2``); None: one guidance for every step.
    expert_guidance: float | None = None
    #: How many input images its edit takes at once (a multi-image edit pipeline); 1: one.
    reference_images: int = 1
    #: The shortest side, in pixels, its pipeline's processor takes for an input image; 0: any.
    min_image_side: int = 0
    #: ``"module:function"`` writing a tiny random-weight pipeline of this checkpoint's own
    #: ``pipeline_class``, where it differs from the family's (the contract kit runs it with
    #: ``checkpoint_name``); empty: the family's ``tiny_pipeline`` serves it.
    tiny_pipeline: str = ""
    #: The folder of ``repo`` its pipeline lives in, where checkpoints share one repo (a dev and a
    #: distilled pipeline side by side); empty: the repo's root. (Plugin API 2.)
    subfolder: str = ""
    #: The hub revision (branch, tag or commit) it is, where checkpoints share one repo's
    #: folders across revisions; None: the repo's default branch. (Plugin API 2.)
    revision: str | None = None
    #: The sigma schedule a distilled checkpoint was trained to sample (eight, say),
    #: passed as the pipeline's ``sigmas``; its length is the step count, and a request for another
    #: count is refused at the check. Empty: the scheduler's own schedule. (Plugin API 2.)
    sigmas: tuple[float, ...] = ()
    #: The checkpoint (its ``name``) LoRAs for this one are trained on, where that is another: a
    #: step-distilled model's undistilled base (the full schedule and real CFG a trainer needs).
    #: A training run asked for this checkpoint by hub id or name takes that one instead, and
    #: says so; a local folder of it trains as given, with the same words. (Plugin API 2.)
    trained_on: str | None = None
    #: Settings its pipeline folders' index holds (``(("is_distilled", True),)``): a local folder
    #: whose index says otherwise is not this checkpoint, whatever its name. (Plugin API 2.)
    index_settings: tuple[tuple[str, object], ...] = ()
    #: Its denoiser's attention heads (``num_attention_heads``), what a context-parallel split
    #: divides among GPUs; None: read from a folder's denoiser config, unknown for a table plan.
    #: (Plugin API 2, additive.)
    attention_heads: int | None = None
    #: Where its MagCache magnitude ratios live (``"module:NAME"``: a sequence of one ratio per
    #: step, calibrated on this checkpoint; diffusers interpolates them to the steps asked for).
    #: None: ``--step-cache magcache`` is not offered for it. (Plugin API 2, additive.)
    mag_ratios: str | None = None

    @property
    def reference(self) -> str:
        """What names this checkpoint alone on the hub: ``repo``, its ``/subfolder`` and
        ``@revision`` where it has them (``org/model/dev@v1``)."""
        sub = f"/{self.subfolder.strip('/')}" if self.subfolder else ""
        return f"{self.repo}{sub}{'@' + self.revision if self.revision else ''}"

    def match_score(self, model_id: str) -> int:
        """Length of the longest pattern matching ``model_id`` (0: no match).

        The most specific pattern wins, so ``Model-Edit`` is not taken for
        ``Model`` when both patterns match.
        """
        lowered = model_id.lower()
        return max(
            (len(p) for p in self.matches if fnmatch.fnmatch(lowered, p.lower())), default=0
        )


from engine.contract.training_types import (  # noqa: E402  (re-exported: plugins import them from here)
    ActivationFigures as ActivationFigures,
    LoraTargetShape as LoraTargetShape,
    Prediction as Prediction,
    TrainingDefaults as TrainingDefaults,
    TrainingMemoryFigures as TrainingMemoryFigures,
    TrainingObjective as TrainingObjective,
    SoundTraining as SoundTraining,
)


#: What a family's diffusers classes may or may not support; see :class:`Capabilities`.
CAPABILITIES: tuple[str, ...] = (
    "step_cache", "attention_dispatcher", "peft_adapters", "regional_compile", "pipeline_lora",
)


@dataclass(frozen=True)
class Capabilities:
    """What the family's classes can do, as its table declares it.

    None (the default) means undeclared: the runtime checks the loaded classes
    and adapts the plan. False is a promise the class lacks it, so the plan
    turns the optimisation off before anything loads (with this reason); True
    says the author checked it. Whatever is declared, the runtime verifies it
    at load and reports ``declared`` beside ``verified``.
    """

    #: The denoiser has diffusers' cache hooks (``enable_cache``,
    #: ``CacheMixin``): First-Block-Cache can engage.
    step_cache: bool | None = None
    #: The denoiser's attention goes through diffusers' attention dispatcher
    #: (``set_attention_backend`` reaches its processors): sage / flash /
    #: xformers backends can be set.
    attention_dispatcher: bool | None = None
    #: The denoiser has diffusers' peft integration (``add_adapter``,
    #: ``load_lora_adapter``); without it the engine's LoRA hooks use peft's
    #: generic ``inject_adapter_in_model`` or the family's own hook.
    peft_adapters: bool | None = None
    #: The denoiser holds modules of the ``compile_regions`` classes.
    regional_compile: bool | None = None
    #: The pipeline class has diffusers' LoRA loader mixin
    #: (``load_lora_weights``); without it LoRAs load through the
    #: ``engine_lora_load`` hook, unfused.
    pipeline_lora: bool | None = None

    def declared(self) -> dict[str, bool | None]:
        """Capability -> what the table says (None: undeclared)."""
        return {name: getattr(self, name) for name in CAPABILITIES}


# The sections of a FamilySpec live in their own module; named from here as ever.
from engine.contract.family_sections import (  # noqa: E402
    COMPONENTS as COMPONENTS,
    FewStepLora as FewStepLora,
    FusionSite as FusionSite,
    LatentGeometry as LatentGeometry,
    LoraLayout as LoraLayout,
    MemoryProbe as MemoryProbe,
    PrecisionRules as PrecisionRules,
    QuantRules as QuantRules,
    StoredLayout as StoredLayout,
    SdcppCompanion as SdcppCompanion,
    SdcppSupport as SdcppSupport,
    SingleFileLayout as SingleFileLayout,
    TrainingSpec as TrainingSpec,
)
from engine.contract.video_spec import OUTPUT_KINDS as OUTPUT_KINDS, OutputKind as OutputKind, VideoSpec as VideoSpec
from engine.contract.video_spec import CallShape as CallShape
from engine.contract.sound import Sound as Sound  # noqa: E402
from engine.contract.call_sections import PipelineLayout as PipelineLayout, Rendering as Rendering  # noqa: E402
from engine.contract.call_sections import BorrowedComponent as BorrowedComponent  # noqa: E402
from engine.contract.call_sections import SpeedRules as SpeedRules  # noqa: E402
from engine.contract.video_memory import VideoMemory as VideoMemory


@dataclass(frozen=True, init=False)
class FamilySpec:
    """Everything the engine may know about a model family without torch.

    Registered through ``engine_register_families``. The per-concern hooks
    (sizes, deny lists, dense base, training modes, compile regions) are
    answered from these fields by the engine's built-in table plugin unless a
    plugin answers them first. The identity and loading facts are fields of
    their own; the rules of one concern live together in a section
    (:class:`QuantRules`, :class:`SingleFileLayout`, :class:`LoraLayout`,
    :class:`TrainingSpec`, :class:`PrecisionRules`, :class:`Capabilities`; plugin API 2's
    :class:`PipelineLayout`, :class:`SpeedRules`, :class:`Rendering`).
    The flat spellings of plugin APIs 0 and 1 (``lora_targets=``, ``denoiser=``...)
    are still accepted, with a warning naming the new one (rows of the register
    of old spellings; :data:`engine.contract.plugin_api.RENAMED`).
    """

    name: str
    label: str
    architecture: Architecture
    pipeline_class: str
    #: ``model_index.json`` ``_class_name`` values that identify this family.
    pipeline_class_names: tuple[str, ...]
    checkpoints: tuple[Checkpoint, ...]
    sizes: ComponentSizes
    #: Dotted path of the family's one torch module (the trainer's
    #: ``encode_prompts`` / ``encode_images`` / ``predict``), imported only
    #: when a model loads or a run starts.
    runtime_module: str = ""
    aliases: tuple[str, ...] = ()
    #: ``"module:function"`` writing a tiny random-weight pipeline to a folder.
    tiny_pipeline: str = ""
    # -- the sections -------------------------------------------------------------
    #: How the pipeline is put together and called (plugin API 2).
    pipeline: PipelineLayout = PipelineLayout()
    #: What the speed levers may touch (plugin API 2).
    speed: SpeedRules = SpeedRules()
    #: What a call gives back and the latent geometry that shapes it (plugin API 2).
    rendering: Rendering = Rendering()
    quantisation: QuantRules = QuantRules()
    single_file: SingleFileLayout = SingleFileLayout()
    #: What stable-diffusion.cpp runs of the family on a CPU machine (nothing by default).
    sdcpp: SdcppSupport = SdcppSupport()
    lora: LoraLayout = LoraLayout()
    training: TrainingSpec = TrainingSpec()
    precision: PrecisionRules = PrecisionRules()
    #: What the family's diffusers classes support; undeclared ones are checked at load.
    capabilities: Capabilities = Capabilities()

    def __init__(self, name: str, label: str, architecture: Architecture, pipeline_class: str,
                 pipeline_class_names: tuple[str, ...], checkpoints: tuple[Checkpoint, ...],
                 sizes: ComponentSizes, **fields: object) -> None:
        from engine.contract.plugin_api import sections_from_legacy

        given = dict(name=name, label=label, architecture=architecture, pipeline_class=pipeline_class,
                     pipeline_class_names=tuple(pipeline_class_names), checkpoints=tuple(checkpoints),
                     sizes=sizes)
        known = {f.name for f in dataclasses.fields(FamilySpec)}
        current = {k: v for k, v in fields.items() if k in known}
        legacy = {k: v for k, v in fields.items() if k not in known}
        current = sections_from_legacy(current, legacy, family=name,
                                       defaults={f.name: f.default for f in dataclasses.fields(FamilySpec)})
        training = current.get("training")
        objective = training.objective if isinstance(training, TrainingSpec) else None
        if not current.get("runtime_module") and objective is not None:
            current["runtime_module"] = getattr(objective, "_legacy_runtime_module", "")
        for f in dataclasses.fields(FamilySpec):
            if f.name in given:
                value = given[f.name]
            elif f.name in current:
                value = current[f.name]
            else:
                value = f.default
            object.__setattr__(self, f.name, value)

    # -- plugin API 0's flat spellings, read (deprecated) -------------------------------

    def __getattr__(self, name: str) -> object:
        from engine.contract.plugin_api import legacy_read

        return legacy_read(self, name)

    def workflows_of(self, checkpoint: Checkpoint | None) -> dict[Workflow, str]:
        """Workflow -> diffusers pipeline class for ``checkpoint`` (the family's
        default checkpoint when None); ``txt2img`` only where declared, but a video family
        that declares none serves text to video by its pipeline class (plugin API 2)."""
        chosen = checkpoint or self.default_checkpoint
        declared = dict(self.pipeline.workflows if chosen.workflows is None else chosen.workflows)
        return declared or ({"txt2img": self.pipeline_class_of(chosen)} if self.rendering.output == "frames" else {})

    def pipeline_class_of(self, checkpoint: Checkpoint | None) -> str:
        """The diffusers class ``checkpoint`` loads as (its own, else the family's)."""
        return (checkpoint or self.default_checkpoint).pipeline_class or self.pipeline_class

    def video_of(self, checkpoint: Checkpoint | None) -> VideoSpec | None:
        """The clips ``checkpoint`` renders (its own spec, else the family's; None: an image family)."""
        chosen = checkpoint or self.default_checkpoint
        return chosen.video or self.rendering.video

    def geometry_of(self, checkpoint: Checkpoint | None) -> LatentGeometry:
        """``checkpoint``'s latent geometry (its own, else the family's)."""
        chosen = checkpoint or self.default_checkpoint
        return chosen.geometry or self.rendering.geometry

    @property
    def denoisers(self) -> tuple[str, ...]:
        """Every pipeline component that denoises: ``denoiser`` and its ``experts``."""
        return (self.pipeline.denoiser, *self.pipeline.experts)

    @property
    def default_checkpoint(self) -> Checkpoint:
        return self.checkpoints[0]

    def checkpoint(self, name: str) -> Checkpoint | None:
        """The checkpoint called ``name`` (its name, its :attr:`~Checkpoint.reference`, or its repo:
        the first of those sharing it), or the one whose patterns match it."""
        lowered = name.lower()
        for key in ("name", "reference", "repo"):
            for checkpoint in self.checkpoints:
                if lowered == str(getattr(checkpoint, key)).lower():
                    return checkpoint
        best = max(self.checkpoints, key=lambda c: c.match_score(name))
        return best if best.match_score(name) else None

    def checkpoint_of_folder(self, name: str, class_name: str) -> Checkpoint | None:
        """A pipeline folder's checkpoint: by its name, unless its ``model_index.json`` class
        says otherwise (a copy of a checkpoint with its own class, in a folder named ``mine``)."""
        named = self.checkpoint(name)
        if self.pipeline_class_of(named) == class_name:
            return named
        own = [c for c in self.checkpoints if self.pipeline_class_of(c) == class_name]
        return max(own, key=lambda c: c.match_score(name)) if own else named

    def is_prequantised(self, model_id: str) -> bool:
        """Whether the model's own name (:func:`model_name`) says it is stored
        pre-quantised. The one test inference and training both use."""
        name = model_name(model_id)
        return any(name_has_marker(name, p) for p in self.quantisation.prequantised_patterns)

    def matches_id(self, model_id: str) -> bool:
        return any(c.match_score(model_id) for c in self.checkpoints)


from engine.contract.plugin_records import PluginInfo as PluginInfo, PluginLoadError as PluginLoadError  # noqa: E402,I001
