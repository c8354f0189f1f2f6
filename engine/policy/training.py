"""Training precision: which base precisions a run can use, and why not.

Pure: a family, a hardware profile and a request in, a decision out. The
same function answers ``info`` (which modes to advertise) and the start
preflight (which request to refuse), so the two can never disagree: a mode
is advertised exactly when its preflight passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.contract.plugins import Registry
from engine.policy.resolved import Resolved, auto, explicit
from engine.policy.training_device import DEVICES, NON_CUDA_ACCELERATORS, Device, training_device  # noqa: F401
from engine.policy.training_memory import (
    BaseFacts,
    TrainingMemoryEstimate,
    TrainingMemoryThresholds,
    TrainingShape,
    estimate_training_memory,
    usable_gb,
)
from engine.contract.schemes import SCHEMES
from engine.contract.types import TRAINING_PRECISIONS, ComponentSizes, FamilySpec

@dataclass(frozen=True)
class TrainingThresholds:
    """Free-memory bands for ``base_precision=auto``, as multiples of the
    family's dense bf16 GB. Starting values; a config may override them."""

    bf16_headroom: float = 1.5
    int8_headroom: float = 1.15


#: What ``auto`` tries, fastest first; it never picks fp8 or mxfp8.
AUTO_PREFERENCE: tuple[str, ...] = ("bf16", "int8", "nf4")


@dataclass(frozen=True)
class MemoryRequest:
    """What the memory estimate needs beyond the family and the machine."""

    base: BaseFacts
    shape: TrainingShape = TrainingShape()
    thresholds: TrainingMemoryThresholds = TrainingMemoryThresholds()

    @classmethod
    def from_table(
        cls,
        family: FamilySpec,
        shape: TrainingShape = TrainingShape(),
        sizes: ComponentSizes | None = None,
    ) -> MemoryRequest:
        """Sized from the family's table alone (hub ids, ``info``); ``sizes``:
        a checkpoint's own component sizes, where the registry has them."""
        sizes = sizes or family.sizes
        return cls(BaseFacts(family.training.dense_gb, sizes.text_encoders_gb, sizes.vae_gb), shape)

    def settled(self, checkpointing: bool) -> MemoryRequest:
        """This request with gradient checkpointing decided."""
        return replace(self, shape=replace(self.shape, gradient_checkpointing=checkpointing))

    def variants(self) -> tuple[MemoryRequest, ...]:
        """The shapes the request allows, fastest first: checkpointing off,
        then on, when it is left to the engine (None)."""
        if self.shape.gradient_checkpointing is None:
            return (self.settled(False), self.settled(True))
        return (self,)

    def estimate(self, family: FamilySpec, mode: str, device: str) -> TrainingMemoryEstimate:
        """The estimate; an undecided checkpointing is sized as on (the least)."""
        if self.shape.gradient_checkpointing is None:
            return self.settled(True).estimate(family, mode, device)
        compute = "fp32" if device == "cpu" else "bf16"
        return estimate_training_memory(
            family, self.base, mode, self.shape, compute=compute, thresholds=self.thresholds
        )


class InsufficientMemory(PreflightError):
    """A run whose estimated peak exceeds the memory it would have."""

    code = "insufficient_memory"

    def __init__(
        self,
        message: str,
        *,
        estimate: TrainingMemoryEstimate,
        available_gb: float,
        fitting_modes: tuple[str, ...],
        suggestions: tuple[str, ...],
    ) -> None:
        super().__init__(message)
        self.estimate = estimate
        self.available_gb = available_gb
        self.fitting_modes = fitting_modes
        self.suggestions = suggestions

    def to_dict(self) -> dict[str, object]:  # type: ignore[override]
        return {
            **super().to_dict(),
            "estimate": self.estimate.to_dict(),
            "available_gb": round(self.available_gb, 2),
            "fitting_modes": list(self.fitting_modes),
            "suggestions": list(self.suggestions),
        }


def resolve_training_precision(
    registry: Registry,
    family: FamilySpec,
    hardware: HardwareProfile,
    requested: str,
    *,
    base_repo: str | None = None,
    device: Device = "auto",
    thresholds: TrainingThresholds = TrainingThresholds(),
    memory: MemoryRequest | None = None,
) -> Resolved[str]:
    """The base precision a run will use. ``auto`` never picks fp8 or mxfp8
    (measured slower than compiled bf16 at LoRA shapes, or riskier).

    With ``memory`` (the run's shape and base) and a family whose activation
    figures are measured, ``auto`` picks the fastest mode whose estimated
    peak fits the free memory; the free-memory bands are the rule only where
    the estimate cannot be made.
    """
    if requested != "auto":
        return explicit(requested)
    if base_repo and registry.dense_base(family, base_repo) is not None:
        return auto("nf4", "the base is pre-quantised (4-bit); it trains in nf4 only")
    if device == "cpu":
        return auto("bf16", "device=cpu: the base is held dense in bf16 (no 4-bit kernels on CPU)")
    if not hardware.cuda:
        return auto("nf4", f"no CUDA device ({hardware.vendor}): nf4, the 4-bit load a non-CUDA accelerator "
                    "runs, is the only choice left")
    free = hardware.free_memory_gb
    dense = family.training.dense_gb
    if free is None or dense <= 0:
        return auto("nf4", "free memory or the dense size is unknown: nf4 is the safe choice")
    denied = registry.quant_deny(family, "training")
    if memory is not None and family.training.memory is not None:
        return _auto_by_estimate(family, hardware, free, memory, denied)
    if free > thresholds.bf16_headroom * dense:
        return auto(
            "bf16",
            f"{free:.1f} GB free > {thresholds.bf16_headroom} x {dense} GB dense bf16: "
            "bf16 with regional compile, the fastest mode",
        )
    if (
        free > thresholds.int8_headroom * dense
        and hardware.torchao_functional
        and "int8" not in denied
    ):
        return auto(
            "int8",
            f"{free:.1f} GB free > {thresholds.int8_headroom} x {dense} GB dense bf16: "
            "int8 (torchao) base",
        )
    return auto(
        "nf4",
        f"{free:.1f} GB free is under {thresholds.int8_headroom} x {dense} GB dense bf16"
        + ("" if hardware.torchao_functional else " or torchao is not functional")
        + ": nf4 base",
    )


def training_precision_preflight_error(
    registry: Registry,
    family: FamilySpec,
    hardware: HardwareProfile,
    base_precision: str,
    *,
    base_repo: str | None = None,
    device: Device = "auto",
    mixed_precision: str = "bf16",
    thresholds: TrainingThresholds = TrainingThresholds(),
    memory: MemoryRequest | None = None,
    resolved: Resolved[str] | None = None,
    rules_only: bool = False,
) -> PreflightError | None:
    """The first reason this precision request is doomed on this machine, or None.

    Cheap and CPU-only; called before anything is evicted or loaded. With
    ``memory``, a mode whose estimated peak exceeds the free memory is
    refused as :class:`InsufficientMemory`, naming what would fit.

    ``resolved``: the base precision already resolved for this run (the trainer's
    preflight resolves it once and checks that); None resolves it here.
    ``rules_only``: stop before the mode is resolved (the checks that hold
    whatever ``auto`` picks).
    """
    if base_precision not in TRAINING_PRECISIONS:
        return PreflightError(
            f"base_precision {base_precision!r} is not one of {', '.join(TRAINING_PRECISIONS)}",
            code="invalid_base_precision",
        )
    if device not in DEVICES:
        return PreflightError(
            f"device {device!r} is not one of {', '.join(DEVICES)}", code="invalid_device"
        )
    if mixed_precision == "fp16" and family.training.requires_bf16:
        return PreflightError(
            f"{family.label} trains in bf16; fp16 mixed precision is refused"
            + (f" ({family.precision.pipeline_fp16_reason()})" if family.precision.pipeline_fp16_reason() else "")
            + ". Use mixed_precision=bf16 on a GPU with native bf16.",
            code="fp16_on_bf16_family",
        )
    if device == "cuda" and not hardware.cuda:
        return PreflightError(
            f"device=cuda but this machine has no CUDA device ({hardware.device_name})",
            code="needs_cuda",
        )
    if not family.training.base_precision_applies:
        # The trainer holds its base in the training dtype: sized as "none" whatever was
        # asked. A leftover explicit value (a reused config) never fails the run: the plan
        # says it is ignored (see engine.training.preflight).
        if memory is None:
            return None
        return training_memory_error(registry, family, hardware, "none", memory, device=device)
    on_cpu = device == "cpu"
    if not on_cpu and hardware.cuda and family.training.requires_bf16 and not hardware.native_bf16:
        fp16_families = [f.name for f in registry.families.values() if not f.training.requires_bf16]
        return PreflightError(
            f"{family.label} LoRA training computes in bf16 whatever the base precision, "
            f"and {hardware.device_name} ({hardware.capability_label}) has no native bf16 "
            "(it needs an Ampere or newer GPU, compute capability 8.0+). Train on a newer GPU"
            + (f", or a family that trains in fp16 ({', '.join(fp16_families)})." if fp16_families else "."),
            code="no_native_bf16",
        )
    accelerator = training_device(hardware, device)
    if not on_cpu and accelerator == "cpu":
        return PreflightError(
            f"{family.label} LoRA training needs a CUDA GPU (or, with an nf4 base, an Apple or Intel GPU); "
            f"this machine has "
            f"{hardware.device_name} ({hardware.vendor}). Pass device=cpu to train "
            "slowly on the CPU (small models and tests).",
            code="needs_cuda",
        )
    if rules_only:
        return None
    mode = (resolved or resolve_training_precision(
        registry, family, hardware, base_precision,
        base_repo=base_repo, device=device, thresholds=thresholds, memory=memory,
    )).value
    if accelerator in NON_CUDA_ACCELERATORS and mode != "nf4":
        return PreflightError(
            f"base_precision={mode} needs CUDA (its kernels are CUDA-only); on {hardware.device_name} "
            f"({accelerator}) a LoRA run holds its base in nf4: use base_precision=nf4 or auto",
            code="needs_cuda",
        )
    denied = registry.quant_deny(family, "training")
    if mode in denied:
        return PreflightError(
            f"{mode} is denied for {family.label} training: {denied[mode]}. "
            "Choose another base precision (int8 or bf16).",
            code="quant_denied",
        )
    dense_base = registry.dense_base(family, base_repo) if base_repo else None
    if dense_base is not None and mode != "nf4":
        return PreflightError(
            f"{base_repo} is pre-quantised (4-bit) and trains in nf4 only; for "
            f"base_precision={mode} use the dense base {dense_base}",
            code="prequantised_base",
        )
    error = _mode_requirement_error(mode, hardware, on_cpu)
    if error is None and memory is not None:
        return training_memory_error(registry, family, hardware, mode, memory, device=device)
    return error


def training_memory_error(
    registry: Registry,
    family: FamilySpec,
    hardware: HardwareProfile,
    mode: str,
    memory: MemoryRequest,
    *,
    device: Device = "auto",
) -> InsufficientMemory | None:
    """:class:`InsufficientMemory` when a ``mode`` run's estimated peak exceeds
    the free memory (with gradient checkpointing, when that is left to the
    engine), else None; also None when free memory or the activations are
    unknown: nothing to refuse on."""
    run_device = "cpu" if device == "cpu" or not hardware.cuda else "cuda"
    free = hardware.free_memory_gb
    if free is None or family.training.memory is None:
        return None
    usable = usable_gb(free, memory.thresholds)
    settled = memory.settled(resolve_checkpointing(family, mode, memory, hardware, device).value)
    estimate = settled.estimate(family, mode, run_device)
    if estimate.peak_gb <= usable:
        return None
    fitting = _fitting_modes(registry, family, hardware, settled, run_device, usable)
    suggestions = _fitting_shapes(family, mode, settled, run_device, usable)
    if not fitting and not settled.shape.gradient_checkpointing:
        lighter = settled.settled(True)
        modes = _fitting_modes(registry, family, hardware, lighter, run_device, usable)
        if modes:
            suggestions += (f"gradient_checkpointing=true with base_precision {' or '.join(modes)}",)
    shape = settled.shape
    where = "host RAM" if run_device == "cpu" else hardware.device_name
    return InsufficientMemory(
        f"{family.label} LoRA training in {mode} needs about {estimate.peak_gb:.1f} GB at "
        f"{shape.resolution}px, batch {shape.batch_size}, rank {shape.lora_rank}"
        f"{', gradient checkpointing' if shape.gradient_checkpointing else ''}; "
        f"{where} would have {free:.1f} GB free after eviction ({usable:.1f} GB usable). "
        f"Breakdown: {'; '.join(estimate.lines())}. "
        + (f"Modes that fit: {', '.join(fitting)}. " if fitting else "No base precision fits this shape. ")
        + (f"What fits instead: {'; '.join(suggestions)}." if suggestions else ""),
        estimate=estimate,
        available_gb=free,
        fitting_modes=fitting,
        suggestions=suggestions,
    )


def resolve_checkpointing(
    family: FamilySpec,
    mode: str,
    memory: MemoryRequest,
    hardware: HardwareProfile,
    device: Device = "auto",
) -> Resolved[bool]:
    """Gradient checkpointing for a ``mode`` run: as asked, else off when the
    run fits without it (recomputing costs about a third more time per step)
    and on when only it makes the run fit."""
    requested = memory.shape.gradient_checkpointing
    if requested is not None:
        return explicit(requested)
    run_device = "cpu" if device == "cpu" or not hardware.cuda else "cuda"
    free = hardware.free_memory_gb
    if free is None or family.training.memory is None:
        if run_device == "cpu":
            return auto(False, "CPU run of unknown size: off (recomputing only slows it)")
        return auto(True, "the run cannot be sized here: on, the safe choice")
    usable = usable_gb(free, memory.thresholds)
    without = memory.settled(False).estimate(family, mode, run_device).peak_gb
    if without <= usable:
        return auto(False, f"fits without it ({without:.1f} GB of {usable:.1f} GB usable): off, the faster")
    with_it = memory.settled(True).estimate(family, mode, run_device).peak_gb
    return auto(
        True,
        f"without it the run needs {without:.1f} GB of {usable:.1f} GB usable; "
        f"with it {with_it:.1f} GB: on",
    )


def _fits(family: FamilySpec, mode: str, memory: MemoryRequest, device: str, usable: float) -> bool:
    """Whether some shape the request allows (checkpointing off or on, when it
    is the engine's to choose) fits ``usable``."""
    return any(v.estimate(family, mode, device).peak_gb <= usable for v in memory.variants())


def _fitting_modes(
    registry: Registry,
    family: FamilySpec,
    hardware: HardwareProfile,
    memory: MemoryRequest,
    device: str,
    usable: float,
) -> tuple[str, ...]:
    """Explicit base precisions that pass every rule here and fit."""
    denied = registry.quant_deny(family, "training")
    return tuple(
        mode for mode in registry.training_precision_modes(family, hardware)
        if mode != "auto" and mode not in denied
        and _mode_requirement_error(mode, hardware, device == "cpu") is None
        and _fits(family, mode, memory, device, usable)
    )


def _fitting_shapes(
    family: FamilySpec, mode: str, memory: MemoryRequest, device: str, usable: float
) -> tuple[str, ...]:
    """Smaller shapes of the same mode that fit: checkpointing, batch, resolution."""
    shape = memory.shape
    tries: list[tuple[str, TrainingShape]] = []
    if not shape.gradient_checkpointing:
        tries.append((f"{mode} with gradient_checkpointing=true", replace(shape, gradient_checkpointing=True)))
    tries += [(f"{mode} with batch_size={b}", replace(shape, batch_size=b)) for b in range(shape.batch_size - 1, 0, -1)]
    tries += [
        (f"{mode} at resolution={r}", replace(shape, resolution=r))
        for r in (1024, 768, 512, 384, 256) if r < shape.resolution
    ]
    found: list[str] = []
    for label, smaller in tries:
        if _fits(family, mode, replace(memory, shape=smaller), device, usable):
            found.append(label)
            if "resolution" in label:
                break  # the largest resolution that fits is the useful one
    return tuple(found)


def _auto_by_estimate(
    family: FamilySpec,
    hardware: HardwareProfile,
    free: float,
    memory: MemoryRequest,
    denied: Mapping[str, str],
) -> Resolved[str]:
    usable = usable_gb(free, memory.thresholds)
    shape = memory.shape
    what = f"{shape.resolution}px, batch {shape.batch_size}"
    for mode in AUTO_PREFERENCE:
        if mode in denied or _mode_requirement_error(mode, hardware, False) is not None:
            continue
        for variant in memory.variants():
            peak = variant.estimate(family, mode, "cuda").peak_gb
            if peak > usable:
                continue
            faster = [m for m in AUTO_PREFERENCE[: AUTO_PREFERENCE.index(mode)] if m not in denied]
            why = f" ({', '.join(faster)} would not fit)" if faster else ""
            how = ", gradient checkpointing" if variant.shape.gradient_checkpointing else ""
            return auto(
                mode,
                f"estimated peak {peak:.1f} GB at {what}{how} fits {usable:.1f} GB usable of "
                f"{free:.1f} GB free: {mode}, the fastest mode that fits{why}",
            )
    return auto("nf4", f"no mode's estimated peak fits {usable:.1f} GB usable at {what}: nf4, the smallest")


def _mode_requirement_error(mode: str, hardware: HardwareProfile, on_cpu: bool) -> PreflightError | None:
    if mode == "nf4":
        if on_cpu:
            return PreflightError(
                "nf4 (bitsandbytes 4-bit) needs a CUDA GPU; on device=cpu use bf16",
                code="needs_cuda",
            )
        if not hardware.bitsandbytes_usable:
            return PreflightError(
                "nf4 needs bitsandbytes with CUDA, which is not usable here; "
                "install it (pip install 'diffusion-engine[nf4]') or choose bf16/int8",
                code="bitsandbytes_unavailable",
            )
    if mode == "int8" and not hardware.torchao_functional:
        return PreflightError(
            "int8 needs a functional torchao (the installed one is missing or a stub whose "
            "quantize_ does nothing); install torchao or choose bf16/nf4",
            code="torchao_unavailable",
        )
    scheme = SCHEMES.get(mode)
    if scheme is not None and scheme.needs is not None and (on_cpu or not getattr(hardware, scheme.needs)):
        return PreflightError(
            f"{mode} training needs CUDA and {scheme.needs_text}; this is "
            f"{hardware.device_name} ({hardware.capability_label})",
            code={"fp8": "fp8_unsupported", "mxfp8": "mxfp8_unsupported"}.get(mode, "preflight_failed"),
        )
    return None
