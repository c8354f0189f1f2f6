"""The sections of a :class:`~engine.contract.types.FamilySpec`: the rules of one concern each.

Frozen, hashable records (mappings an author writes are stored as sorted
pairs): quantisation rules, the single-file layout, the LoRA layout, the
training spec (with the memory tool's probe) and the precision rules. Named
from :mod:`engine.contract.types`, as every other type of the plugin contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

# Named here before they had a module of their own (API 1 plugins import them from here).
from engine.contract.schemes import SCHEMES
from engine.contract.video_spec import OUTPUT_KINDS as OUTPUT_KINDS, OutputKind as OutputKind, VideoSpec as VideoSpec

if TYPE_CHECKING:  # annotations only: engine.contract.types imports this module
    from engine.contract.training_types import SoundTraining, TrainingDefaults, TrainingMemoryFigures, TrainingObjective
    from engine.contract.types import Purpose, QuantDeny


def _pairs(value: object) -> tuple[tuple[str, object], ...]:
    """A mapping (as an author writes it) or pairs, as sorted pairs: hashable and comparable."""
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), v) for k, v in items))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StoredLayout:
    """A layout a publisher stores the family's denoiser in, other than diffusers': a repo whose
    fused attention diffusers' ``from_pretrained`` would leave random-initialised (it drops the
    keys it does not know). The preflight recognises it from the denoiser's safetensors headers
    (a tensor name ending ``marker``); the loader builds each denoiser on ``meta`` and loads the
    state dict ``convert`` returns, strictly: every parameter given, none left over.
    """

    #: How the plan and the status name it (``fp8_fused_qkv``).
    name: str
    #: The end of a tensor name only this layout has (``.attention.qkv.weight``).
    marker: str
    #: ``module:function`` taking the stored state dict and giving diffusers' (torch code).
    convert: str
    #: What the conversion does, for the status record ("split ... dequantised ...").
    note: str


@dataclass(frozen=True)
class QuantRules:
    """How the family's weights may be quantised, and what each scheme costs it."""

    #: Schemes denied for inference / for training, each with its measured reason.
    deny_inference: tuple[QuantDeny, ...] = ()
    deny_training: tuple[QuantDeny, ...] = ()
    #: Steady size factors per scheme for this family's transformer, where they
    #: differ from the generic ones (its layer mix, under the filter); a mapping
    #: or ``(scheme, factor)`` pairs.
    factors: tuple[tuple[str, float], ...] = ()
    #: The inference build's factors where they differ from ``factors`` (the
    #: trainer's), because ``int8_dense_modules`` keeps more dense there.
    inference_factors: tuple[tuple[str, float], ...] = ()
    #: Name fragments of Linears int8 keeps dense, beyond the engine's generic
    #: norm / modulation / timestep rule (layers run at M = prompt tokens or batch).
    int8_dense_modules: tuple[str, ...] = ()
    #: Inference denials a machine capability lifts: ``(scheme, HardwareProfile
    #: attribute)`` pairs (``("fp8", "fp8_activation_floor")``). Only this table's own
    #: deny of that scheme is lifted; another plugin's deny of it stands.
    deny_lifted_by: tuple[tuple[str, str], ...] = ()
    #: Text-encoder schemes the family must not use, with the reason.
    text_encoder_deny: tuple[QuantDeny, ...] = ()
    #: The family's keep-in-bf16 schedule for int8 text encoders: name fragments of
    #: the encoder Linears int8 leaves dense. None: no schedule, so an int8 encoder
    #: request runs as layerwise fp8 instead (the record says so).
    text_encoder_int8_keep: tuple[str, ...] | None = None
    #: Patterns naming a pre-quantised repo (``*bnb-4bit*``): a ``*marker*`` matches the
    #: marker as whole tokens of the model's name (``*int4*`` takes ``model-int4``, not
    #: ``checkpoint4``); any other glob matches the whole name.
    prequantised_patterns: tuple[str, ...] = ()
    #: The dense base to use when a pre-quantised repo matches no checkpoint.
    default_dense_base: str = ""
    #: Layouts a publisher stores the denoiser in that diffusers' ``from_pretrained`` would
    #: load wrong (plugin API 2, additive): converted on load, recognised from the headers.
    stored_layouts: tuple[StoredLayout, ...] = ()

    def __post_init__(self) -> None:
        for name in ("factors", "inference_factors", "deny_lifted_by"):
            object.__setattr__(self, name, _pairs(getattr(self, name)))

    def deny(self, purpose: Purpose) -> tuple[QuantDeny, ...]:
        return self.deny_inference if purpose == "inference" else self.deny_training

    def factor(self, scheme: str, *, inference: bool = False) -> float | None:
        """The family's own steady factor for ``scheme`` (None: the generic one applies)."""
        own = dict(self.factors)
        if inference:
            own.update(self.inference_factors)
        row = SCHEMES.get(scheme)
        return own.get(scheme, own.get(row.sized_as) if row is not None and row.sized_as else None)


@dataclass(frozen=True)
class FusionSite:
    """A denoiser block class whose elementwise glue the engine fuses (``torch.addcmul``):
    the methods rewritten and how many fusible expressions they hold today. A different
    count at load means diffusers changed the block: it is left unpatched, with the reason."""

    block: str
    rewrites: int
    methods: tuple[str, ...] = ("forward",)


@dataclass(frozen=True)
class SingleFileLayout:
    """What a single ``.safetensors`` (or ``.gguf``) file of this family holds."""

    #: Substrings of state-dict keys that identify this family's denoiser in a
    #: single-file checkpoint (diffusers or original key names); a file is the
    #: family most of whose markers it holds.
    markers: tuple[str, ...] = ()
    #: Whether one file holds the whole pipeline (denoiser, text encoders, VAE),
    #: loaded with ``from_single_file`` and no base; False: a file is the denoiser.
    whole_pipeline: bool = False
    #: Key prefixes of each part in such a file: ``(prefix, "denoiser" |
    #: "text_encoders" | "vae")``.
    parts: tuple[tuple[str, str], ...] = ()
    #: Why a ``.gguf`` of this family cannot be loaded, when it cannot.
    gguf_refused_reason: str = ""


@dataclass(frozen=True)
class SdcppCompanion:
    """One file stable-diffusion.cpp reads beside the model file (a VAE, a text encoder)."""

    #: The binding's argument for it (``vae_path``, ``clip_l_path``, ``t5xxl_path``, ``llm_path``).
    argument: str
    #: What the file is, for messages ("the autoencoder").
    label: str
    #: Glob patterns of its name, looked for beside the model file (first match wins).
    patterns: tuple[str, ...]
    #: Without it sd.cpp cannot run (True), or runs degraded (False; ``missing`` says how).
    required: bool = True
    missing: str = ""


@dataclass(frozen=True)
class SdcppSupport:
    """What stable-diffusion.cpp (the CPU engine) runs of this family; ``kinds`` empty: nothing.

    sd.cpp reads the files people download for it (a GGUF or an original-layout
    ``.safetensors``), never a diffusers folder; the plan sends a supported file
    there on a CPU machine (see :mod:`engine.policy.runtime_engine`)."""

    #: Model kinds it reads: ``single_file`` / ``gguf`` (the denoiser alone, with
    #: ``companions`` beside it) or ``single_file_pipeline`` (a whole checkpoint).
    kinds: tuple[str, ...] = ()
    companions: tuple[SdcppCompanion, ...] = ()
    #: Workflows it runs for this family (``txt2img``, ``img2img``).
    workflows: tuple[str, ...] = ("txt2img",)
    #: The binding's argument the checkpoint's guidance goes to: ``cfg_scale``
    #: (classifier-free) or ``guidance`` (a distilled-guidance model; cfg stays 1).
    guidance_argument: str = "cfg_scale"
    #: ``"module:function"`` writing tiny random files sd.cpp reads (tests, benchmarks).
    tiny_files: str = ""
    #: Why a kind it does not list is refused, when the family says (messages).
    note: str = ""


@dataclass(frozen=True)
class FewStepLora:
    """A step-distillation LoRA the family's users download (Lightning, lightx2v, Turbo, DMD),
    told by its file name, and the sampling it was distilled for (plugin API 2, additive).
    Loading one sets its steps and guidance where the request says none, with the reason in
    the plan; a LoRA that says its own (``sampling`` in its metadata) wins over the table."""

    #: How the plan names it ("Lightning, 4 steps").
    name: str
    #: A glob over the file's name, lower-cased (``*lightning*4step*``).
    pattern: str
    steps: int
    guidance: float
    #: The expert it lands on where that is not the denoiser (a two-expert model's low-noise half:
    #: ``transformer_2``), for a pair published as two files.
    component: str | None = None
    #: The flow-matching timestep shift it was distilled at (the scheduler's ``shift`` or
    #: ``flow_shift``, held constant); None: the checkpoint's schedule.
    shift: float | None = None


@dataclass(frozen=True)
class LoraLayout:
    """Which modules a LoRA adapts, and how its keys are spelled outside diffusers."""

    #: Module names (or their last parts) a LoRA adapts by default.
    targets: tuple[str, ...] = ()
    #: Substrings of LoRA keys (diffusers, kohya, ComfyUI or ai-toolkit
    #: spellings) typical of this family; the family whose markers match the
    #: most keys is the one a foreign LoRA is said to look like.
    key_markers: tuple[str, ...] = ()
    #: How the kohya / ComfyUI export names the modules where the original
    #: checkpoint's layout differs: ``(kohya module, (diffusers modules...))``
    #: with ``{i}`` for a block index; several modules are fused in order.
    kohya_map: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: The step-distillation LoRAs its users download, told by their file names.
    few_step: tuple[FewStepLora, ...] = ()


@dataclass(frozen=True)
class LatentGeometry:
    """How the family's VAE and denoiser shape an image: the engine reads every
    latent size and token count from here, never from a constant.

    The default is the DiTs' shape (an 8x VAE, 2x2 patches: one token per
    16x16 pixels). A family with a deeper VAE or no patching says so (Sana's
    DC-AE: 32x, patch 1, one token per 32x32 pixels). A UNet has no tokens:
    its table keeps patch 2, the 16-pixel square its activation figures count.
    """

    #: Pixels per latent cell along each side (the VAE's downsampling).
    spatial_compression: int = 8
    #: Latent cells per token along each side (the denoiser's patchify).
    patch_size: int = 2
    #: Frames per latent frame (1 for images; a video VAE's temporal stride).
    temporal_compression: int = 1
    #: Channels of a latent cell (0: unsaid; the memory probe's ``latent_channels`` is the trainer's).
    latent_channels: int = 0

    def __post_init__(self) -> None:
        for name in ("spatial_compression", "patch_size", "temporal_compression", "latent_channels"):
            value = getattr(self, name)
            least = 0 if name == "latent_channels" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"LatentGeometry.{name} must be a whole number of at least {least}, not {value!r}")

    @property
    def token_pixels(self) -> int:
        """The side in pixels of the square one token covers."""
        return self.spatial_compression * self.patch_size

    def latent_side(self, pixels: int) -> int:
        """Latent cells along a side of ``pixels``."""
        return pixels // self.spatial_compression

    def image_tokens(self, width: int, height: int | None = None) -> int:
        """Tokens the denoiser sees for a ``width`` x ``height`` image (square when ``height`` is None)."""
        side = self.token_pixels
        return (width // side) * ((width if height is None else height) // side)

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` (a causal video VAE: the first frame alone, then
        ``temporal_compression`` frames each); 1 for an image."""
        return 1 + max(0, frames - 1) // self.temporal_compression

    def clip_tokens(self, frames: int, width: int, height: int | None = None) -> int:
        """Tokens the denoiser sees for a clip of ``frames`` at ``width`` x ``height`` (patch 1 in time)."""
        return self.latent_frames(frames) * self.image_tokens(width, height)


@dataclass(frozen=True)
class MemoryProbe:
    """How the training-memory tool builds and feeds the family's denoiser.

    :mod:`engine.testing.memory_figures` builds the denoiser with its
    diffusers class at the real widths and reduced depths, runs LoRA
    training steps under fake tensors and derives the family's
    :class:`ActivationFigures` (``--derive``), or checks the estimate against
    what it measures. Config values are ``(key, value)`` pairs (a mapping is
    accepted), over the class's own defaults.
    """

    #: The diffusers model class of the denoiser (``SD3Transformer2DModel``).
    model_class: str
    #: Classes of the repeated blocks ``ActivationFigures.blocks`` counts.
    blocks: tuple[str, ...]
    #: Prompt positions the trainer feeds the denoiser (the runtime's max sequence length).
    text_tokens: int
    #: The config key holding the prompt embedding width (``joint_attention_dim``).
    text_dim: str
    #: Two reduced depths: ``--derive`` differences them (what one more block adds).
    derive: tuple[tuple[str, object], ...]
    deeper: tuple[tuple[str, object], ...] | None
    #: A third depth the accuracy check runs (empty: the check runs the full size only).
    check: tuple[tuple[str, object], ...] = ()
    #: Narrow widths for the real-tensor validation of the byte counter.
    narrow: tuple[tuple[str, object], ...] = ()
    #: The real checkpoint's config where the class's defaults are not it.
    full: tuple[tuple[str, object], ...] = ()
    latent_channels: int = 16
    #: Width of the pooled prompt embedding the denoiser takes (0: none).
    pooled_dim: int = 0
    #: Blocks that see one stream only, each counted as half a block (a pair is one block's work).
    half_blocks: tuple[str, ...] = ()
    #: A video family's clip length the tool derives with (1: images).
    frames: int = 1
    #: The clip lengths its accuracy check runs (empty: ``frames`` only).
    check_frames: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("derive", "check", "narrow", "full"):
            object.__setattr__(self, name, _pairs(getattr(self, name)))
        if self.deeper is not None:
            object.__setattr__(self, "deeper", _pairs(self.deeper))


@dataclass(frozen=True)
class TrainingSpec:
    """How the family trains: its objective, what it holds, its defaults and precision rules."""

    #: What the trainer loop needs to know (None: the family is not trainable).
    objective: TrainingObjective | None = None
    #: bf16 GB of the denoiser a LoRA trainer holds dense.
    dense_gb: float = 0.0
    #: Activation and LoRA-shape figures for the memory estimate; None where
    #: unmeasured (the estimate then says it cannot size the run).
    memory: TrainingMemoryFigures | None = None
    #: Trainer defaults (LR, warmup, flow shift); None: the engine's.
    defaults: TrainingDefaults | None = None
    #: Whether the trainer honours ``base_precision`` (DiT yes, UNet no).
    base_precision_applies: bool = True
    #: Whether the trainer computes in bf16 whatever the base precision.
    requires_bf16: bool = False
    #: How the training-memory tool builds the denoiser to derive ``memory`` (None: it cannot).
    probe: MemoryProbe | None = None
    #: How a clip's sound is trained beside its picture (None: the picture alone). (Plugin API 2.)
    sound: SoundTraining | None = None

    def __post_init__(self) -> None:
        prediction = self.objective.prediction if self.objective is not None else None
        if self.sound is not None and prediction != "flow_matching":
            raise ValueError("TrainingSpec.sound noises a clip's sound on a flow-matching schedule beside its "
                             f"picture: the objective must predict flow_matching, not {prediction}")


#: The pipeline components fp16 safety is stated for.
COMPONENTS: tuple[str, ...] = ("denoiser", "text_encoders", "vae")


@dataclass(frozen=True)
class PrecisionRules:
    """Where fp16 compute is unsafe, component by component.

    An fp16-unsafe denoiser keeps the family off fp16 (bf16 where native, else
    fp32; an fp16 request is refused with the reason). An fp16-unsafe text
    encoder or VAE alone does not: the denoiser computes in fp16 and that
    component beside it in bf16 where native, else fp32, each with the reason
    (the plan's ``text_encoder_dtype`` and ``vae_dtype``).
    """

    #: ``(component, reason)`` for each component whose fp16 compute renders
    #: black or fails (``denoiser``, ``text_encoders``, ``vae``).
    fp16_unsafe: tuple[tuple[str, str], ...] = ()
    #: ``(component, reason)`` for each component loaded in fp32 whatever the compute
    #: dtype (a video VAE that bands and blackens frames in bf16); its table size is fp32's.
    keep_fp32: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        unknown = [c for c, _ in (*self.fp16_unsafe, *self.keep_fp32) if c not in COMPONENTS]
        if unknown:
            raise ValueError(f"PrecisionRules names {unknown}; components are {', '.join(COMPONENTS)}")

    def keeps_fp32(self, component: str) -> bool:
        """Whether ``component`` loads in fp32 whatever the compute dtype."""
        return any(name == component for name, _ in self.keep_fp32)

    def fp16_safe(self, component: str = "denoiser") -> bool:
        return all(c != component for c, _ in self.fp16_unsafe)

    def fp16_reason(self, component: str = "denoiser") -> str:
        return next((reason for c, reason in self.fp16_unsafe if c == component), "")

    def pipeline_fp16_safe(self) -> bool:
        """Whether every component may compute in fp16 (the denoiser's alone decides the compute
        dtype: see :mod:`engine.policy.component_dtypes`)."""
        return not self.fp16_unsafe

    def pipeline_fp16_reason(self) -> str:
        """Why it may not: the denoiser's reason as written, another component's named."""
        return "; ".join(reason if component == "denoiser" else f"its {component.replace('_', ' ')}: {reason}"
                         for component, reason in self.fp16_unsafe)
