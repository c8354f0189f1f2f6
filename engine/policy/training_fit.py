"""Whether a training run fits: its memory request, the refusal that names
what would fit instead, gradient checkpointing, and each base precision's
own requirements (kernels, libraries, GPUs).

Pure and torch-free, beside :mod:`engine.policy.training_memory` (the
estimate's arithmetic); :mod:`engine.policy.training` resolves the base
precision and runs the preflight over these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.contract.plugins import Registry
from engine.contract.schemes import SCHEMES
from engine.contract.types import ComponentSizes, FamilySpec
from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.resolved import Resolved, auto, explicit
from engine.policy.training_device import Device
from engine.policy.training_memory import (
    BaseFacts,
    TrainingMemoryEstimate,
    TrainingMemoryThresholds,
    TrainingShape,
    estimate_training_memory,
    usable_gb,
)


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
        a checkpoint's own component sizes, where the registry has them. A
        checkpoint sized apart from its family (a 32B variant beside a 4B
        default) holds its own transformer as the dense base."""
        sizes = sizes or family.sizes
        dense = family.training.dense_gb if sizes == family.sizes else sizes.transformer_gb
        return cls(BaseFacts(dense, sizes.text_encoders_gb, sizes.vae_gb), shape)

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

    def to_dict(self) -> dict[str, object]:
        return {
            **super().to_dict(),
            "estimate": self.estimate.to_dict(),
            "available_gb": round(self.available_gb, 2),
            "fitting_modes": list(self.fitting_modes),
            "suggestions": list(self.suggestions),
        }


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
    fitting = fitting_modes(registry, family, hardware, settled, run_device, usable)
    suggestions = fitting_shapes(family, mode, settled, run_device, usable)
    if not fitting and not settled.shape.gradient_checkpointing:
        lighter = settled.settled(True)
        modes = fitting_modes(registry, family, hardware, lighter, run_device, usable)
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


def fitting_modes(
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
        and mode_requirement_error(mode, hardware, device == "cpu") is None
        and _fits(family, mode, memory, device, usable)
    )


def fitting_shapes(
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


def mode_requirement_error(mode: str, hardware: HardwareProfile, on_cpu: bool) -> PreflightError | None:
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
