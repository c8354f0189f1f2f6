"""What each family costs and offers on a machine, before anything is loaded.

``images_info`` answers "how big is it under each scheme" from the tables;
``training_info`` answers "which base precisions can I train in here", by
running the training preflight for every mode the family has, so what is
advertised is exactly what a start would accept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry
from engine.policy.schemes import SCHEME_SIZES, transformer_gb
from engine.policy.training import (
    MemoryRequest,
    TrainingThresholds,
    resolve_training_precision,
    training_precision_preflight_error,
)
from engine.policy.training_memory import TrainingShape
from engine.types import ComponentSizes, FamilySpec


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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def images_info(registry: Registry, family: FamilySpec) -> ImagesInfo:
    sizes = registry.component_sizes(family, None)
    resident = {
        scheme: round(
            transformer_gb(sizes.transformer_gb, scheme, factor=family.quant_factors.get(scheme))[0]
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
        fp16_compute_safe=family.fp16_compute_safe,
    )


def training_info(
    registry: Registry,
    family: FamilySpec,
    hardware: HardwareProfile,
    thresholds: TrainingThresholds = TrainingThresholds(),
) -> TrainingInfo:
    supports_compile = bool(registry.compile_regions(family))
    candidates = registry.training_precision_modes(family, hardware)
    if not candidates:
        # The trainer ignores base_precision: only the machine-wide checks apply.
        error = training_precision_preflight_error(registry, family, hardware, "auto")
        where = "on the GPU" if hardware.cuda else f"on {hardware.vendor} (slowly)"
        note = error.message if error else (
            f"{family.label} trains {where}; base precision does not apply to its trainer"
            + ("" if hardware.native_bf16 else " (fp16 mixed precision: no native bf16 here)")
        )
        return TrainingInfo(family.name, error is None, (), None, supports_compile, note)
    memory = MemoryRequest.from_table(family, TrainingShape(gradient_checkpointing=None))
    errors = {
        mode: training_precision_preflight_error(
            registry, family, hardware, mode, thresholds=thresholds, memory=memory
        )
        for mode in candidates
    }
    modes = tuple(mode for mode, error in errors.items() if error is None)
    if not modes:
        first = next(e for e in errors.values() if e is not None)
        return TrainingInfo(family.name, False, (), None, supports_compile, first.message)
    recommended = resolve_training_precision(
        registry, family, hardware, "auto", thresholds=thresholds, memory=memory
    )
    best = recommended.value if "auto" in modes else next(m for m in modes if m != "auto")
    free = "unknown" if hardware.free_memory_gb is None else f"{hardware.free_memory_gb:.1f} GB"
    note = (
        f"{free} free; dense bf16 base {family.training_dense_gb} GB; "
        + (recommended.reason if "auto" in modes else f"auto is unavailable, {best} is")
    )
    device = "cuda" if hardware.cuda else "cpu"
    peaks = {
        mode: round(memory.estimate(family, mode, device).peak_gb, 1)
        for mode in modes if mode != "auto" and family.training_memory is not None
    }
    breakdown = memory.estimate(family, best, device).to_dict() if family.training_memory else None
    return TrainingInfo(family.name, True, modes, best, supports_compile, note, peaks, breakdown)
