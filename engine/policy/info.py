"""What each family costs and offers on a machine, before anything is loaded.

``images_info`` answers "how big is it under each scheme" from the tables;
``training_info`` answers "which base precisions can I train in here", by
running the training preflight for every mode the family has, so what is
advertised is exactly what a start would accept.
"""

from __future__ import annotations

from typing import Any
from dataclasses import asdict, dataclass, field, replace

from engine.hardware.profile import HardwareProfile
from engine.contract.plugins import Registry
from engine.policy.encoders import encoder_denials, encoder_gb
from engine.contract.schemes import ENCODER_SCHEMES
from engine.policy.schemes import SCHEME_SIZES, transformer_gb
from engine.policy.training import (
    Device,
    MemoryRequest,
    TrainingThresholds,
    resolve_training_precision,
    training_device,
    training_precision_preflight_error,
)
from engine.policy.training_memory import TrainingShape
from engine.contract.types import TRAINING_PRECISIONS, ComponentSizes, FamilySpec


#: Base precisions the trainer runs eager: bitsandbytes 4-bit layers are not
#: compiled, and inductor rejects the int8 tensor-subclass training graph.
UNCOMPILED_MODES: tuple[str, ...] = ("nf4", "int8")


@dataclass(frozen=True)
class ImagesInfo:
    family: str
    label: str
    checkpoints: tuple[str, ...]
    sizes_gb: ComponentSizes
    #: Weights held resident, GB, with the transformer in each scheme.
    resident_gb: dict[str, float]
    #: Schemes a plugin denies for inference, with the reason.
    denied: dict[str, str]
    fp16_compute_safe: bool
    #: What the table declares its classes support (yes / no / undeclared:
    #: checked on the loaded classes, reported by the load's ``capabilities``).
    capabilities: dict[str, str] = field(default_factory=dict)
    #: The text encoders' GB per ``text_encoder_quant`` scheme the table allows.
    text_encoders_gb: dict[str, float] = field(default_factory=dict)
    #: Text-encoder schemes the table denies, with the reason.
    text_encoder_denied: dict[str, str] = field(default_factory=dict)
    #: ``images`` or ``frames``; for a video family each checkpoint's clips (lattice, fps, presets).
    output: str = "images"
    video: dict[str, dict[str, object]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["sizes_gb"] = {
            "transformer": self.sizes_gb.transformer_gb,
            "text_encoders": self.sizes_gb.text_encoders_gb,
            "vae": self.sizes_gb.vae_gb,
        }
        return data


@dataclass(frozen=True)
class TrainingInfo:
    family: str
    trainable: bool
    #: Base precisions a start would accept here (empty: no selector).
    precision_modes: tuple[str, ...]
    recommended_precision: str | None
    supports_compile: bool
    vram_note: str
    #: Estimated peak GB per advertised mode at the default shape (512px,
    #: batch 1, rank 16), from the family's table.
    estimated_peak_gb: dict[str, float] = field(default_factory=dict)
    #: The recommended mode's breakdown at that shape.
    memory_breakdown: dict[str, object] | None = None
    #: Every other base precision, with why a start would refuse it here
    #: (so a selector can show it disabled with the reason).
    denied_modes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def images_info(registry: Registry, family: FamilySpec) -> ImagesInfo:
    sizes = registry.component_sizes(family, None)
    resident = {
        scheme: round(
            transformer_gb(sizes.transformer_gb, scheme, factor=family.quantisation.factor(scheme))[0]
            + sizes.text_encoders_gb
            + sizes.vae_gb,
            2,
        )
        for scheme in SCHEME_SIZES
    }
    return ImagesInfo(
        family=family.name,
        label=family.label,
        checkpoints=tuple(c.label for c in family.checkpoints),
        sizes_gb=sizes,
        resident_gb=resident,
        denied=dict(registry.quant_deny(family, "inference")),
        fp16_compute_safe=family.precision.fp16_safe("denoiser"),
        capabilities={
            name: {True: "yes", False: "no", None: "undeclared (checked at load)"}[value]
            for name, value in family.capabilities.declared().items()
        },
        text_encoders_gb={
            scheme: round(encoder_gb(sizes.text_encoders_gb, scheme), 2)
            for scheme in ENCODER_SCHEMES if scheme not in encoder_denials(family)
        },
        text_encoder_denied=encoder_denials(family),
        output=family.rendering.output,
        video={c.name: _clip_rules(family.video_of(c)) for c in family.checkpoints
               if family.rendering.output == "frames" and family.video_of(c) is not None},
    )


def _clip_rules(video: Any) -> dict[str, object]:
    return {"fps": video.fps, "default_frames": video.default_frames, "lattice": video.lattice,
            "frames": [video.min_frames, video.max_frames], "size_multiple": video.size_multiple,
            "presets": [f"{w}x{h}" for w, h in video.presets]}


def training_info(
    registry: Registry,
    family: FamilySpec,
    hardware: HardwareProfile,
    thresholds: TrainingThresholds = TrainingThresholds(),
    device: Device = "auto",
    memory: MemoryRequest | None = None,
) -> TrainingInfo:
    """What training ``family`` on ``hardware`` offers, and why each other base precision is not
    offered; ``device`` as a run would ask (``cpu``: what trains on the CPU here). ``memory``:
    the run's own sizes (a chosen base's headers at a chosen resolution); by default the
    family table's default checkpoint at the default resolution."""
    memory = memory or MemoryRequest.from_table(family, TrainingShape(gradient_checkpointing=None))
    info = _offered(registry, family, hardware, thresholds, device, memory)
    candidates = registry.training_precision_modes(family, hardware) if info.trainable else ()
    denied: dict[str, str] = {}
    for mode in TRAINING_PRECISIONS:
        if mode in info.precision_modes or (mode == "auto" and info.trainable and not candidates):
            continue
        if not candidates:  # not trainable here, or base precision does not apply to its trainer
            denied[mode] = info.vram_note
        elif mode in candidates:
            error = training_precision_preflight_error(
                registry, family, hardware, mode, thresholds=thresholds, memory=memory, device=device
            )
            denied[mode] = error.message if error else f"{mode} is not offered here"
        else:
            denied[mode] = f"the {family.label} plugin does not offer {mode} training on this machine"
    return replace(info, denied_modes=denied)


def _offered(
    registry: Registry, family: FamilySpec, hardware: HardwareProfile, thresholds: TrainingThresholds,
    device: Device, memory: MemoryRequest,
) -> TrainingInfo:
    if registry.training_objective(family) is None:
        return TrainingInfo(family.name, False, (), None, False,
                            f"the {family.name} plugin provides no trainer (no training_objective)")
    regions = bool(registry.compile_regions(family))
    candidates = registry.training_precision_modes(family, hardware)
    if not candidates:
        # The trainer ignores base_precision: only the machine-wide checks apply.
        error = training_precision_preflight_error(registry, family, hardware, "auto", device=device)
        note = error.message if error else (
            f"{family.label} trains {_training_device(hardware)}; base precision does not apply to its trainer"
            + ("" if hardware.native_bf16 or not hardware.cuda else " (fp16 mixed precision: no native bf16 here)")
        )
        # A family that cannot train here has nothing to compile.
        return TrainingInfo(family.name, error is None, (), None, error is None and regions, note)
    errors = {
        mode: training_precision_preflight_error(
            registry, family, hardware, mode, thresholds=thresholds, memory=memory, device=device
        )
        for mode in candidates
    }
    modes = tuple(mode for mode, error in errors.items() if error is None)
    if not modes:
        # Nothing trains here, so nothing compiles: the selector is hidden.
        first = next(e for e in errors.values() if e is not None)
        return TrainingInfo(family.name, False, (), None, False, first.message)
    recommended = resolve_training_precision(
        registry, family, hardware, "auto", thresholds=thresholds, memory=memory, device=device
    )
    best = recommended.value if "auto" in modes else next(m for m in modes if m != "auto")
    free = "unknown" if hardware.free_memory_gb is None else f"{hardware.free_memory_gb:.1f} GB"
    note = (
        f"{free} free; dense bf16 base {memory.base.dense_gb:.3g} GB"
        + (f" (from its {memory.base.source})" if memory.base.source != "table" else "") + "; "
        + (recommended.reason if "auto" in modes else f"auto is unavailable, {best} is")
    )
    where = training_device(hardware, device)
    peaks = {
        mode: round(memory.estimate(family, mode, where).peak_gb, 1)
        for mode in modes if mode != "auto" and family.training.memory is not None
    }
    breakdown = memory.estimate(family, best, where).to_dict() if family.training.memory else None
    compiles = regions and any(m not in UNCOMPILED_MODES for m in modes if m != "auto")
    return TrainingInfo(family.name, True, modes, best, compiles, note, peaks, breakdown)


def _training_device(hardware: HardwareProfile) -> str:
    """Where a dense-base trainer runs: the CUDA GPU, else the CPU (a
    non-CUDA accelerator takes only 4-bit bases: see ``training_device``)."""
    if hardware.cuda:
        return "on the GPU"
    if hardware.vendor == "cpu":
        return "on the CPU (slowly)"
    return (f"on the CPU (slowly): a dense-base trainer runs on CUDA or the CPU, not on {hardware.device_name} "
            f"({hardware.vendor})")
