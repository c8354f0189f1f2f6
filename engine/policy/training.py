"""Training precision: which base precisions a run can use, and why not.

Pure: a family, a hardware profile and a request in, a decision out. The
same function answers ``info`` (which modes to advertise) and the start
preflight (which request to refuse), so the two can never disagree: a mode
is advertised exactly when its preflight passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.contract.plugins import Registry
from engine.policy.resolved import Resolved, auto, explicit
from engine.policy.training_device import NON_CUDA_ACCELERATORS, Device, training_device
from engine.requests.choices import DEVICES
from engine.policy.training_fit import (
    InsufficientMemory,
    MemoryRequest,
    mode_requirement_error,
    resolve_checkpointing,
    training_memory_error,
)
from engine.policy.training_memory import usable_gb
from engine.contract.types import TRAINING_PRECISIONS, FamilySpec

#: The training policy's names; the memory request and its refusal live in
#: :mod:`engine.policy.training_fit` and are imported from here too.
__all__ = [
    "AUTO_PREFERENCE",
    "DEVICES",
    "Device",
    "InsufficientMemory",
    "MemoryRequest",
    "NON_CUDA_ACCELERATORS",
    "TrainingThresholds",
    "resolve_checkpointing",
    "resolve_training_precision",
    "training_device",
    "training_memory_error",
    "training_precision_preflight_error",
]


@dataclass(frozen=True)
class TrainingThresholds:
    """Free-memory bands for ``base_precision=auto``, as multiples of the
    family's dense bf16 GB. Starting values; a config may override them."""

    bf16_headroom: float = 1.5
    int8_headroom: float = 1.15


#: What ``auto`` tries, fastest first; it never picks fp8 or mxfp8.
AUTO_PREFERENCE: tuple[str, ...] = ("bf16", "int8", "nf4")


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
    dense = memory.base.dense_gb if memory is not None else family.training.dense_gb  # the base's own size
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
    error = _request_error(registry, family, hardware, base_precision, device, mixed_precision)
    if error is not None:
        return error
    if not family.training.base_precision_applies:
        # The trainer holds its base in the training dtype: sized as "none" whatever was
        # asked. A leftover explicit value (a reused config) never fails the run: the plan
        # says it is ignored (see engine.training.preflight).
        if memory is None:
            return None
        return training_memory_error(registry, family, hardware, "none", memory, device=device)
    error = _accelerator_error(registry, family, hardware, device)
    if error is not None or rules_only:
        return error
    mode = (resolved or resolve_training_precision(
        registry, family, hardware, base_precision,
        base_repo=base_repo, device=device, thresholds=thresholds, memory=memory,
    )).value
    error = _mode_error(registry, family, hardware, mode, base_repo=base_repo, device=device)
    if error is None and memory is not None:
        return training_memory_error(registry, family, hardware, mode, memory, device=device)
    return error


def _request_error(
    registry: Registry, family: FamilySpec, hardware: HardwareProfile, base_precision: str,
    device: Device, mixed_precision: str,
) -> PreflightError | None:
    """The request's own mistakes: a family with no trainer, an unknown value, fp16 on a bf16
    family, cuda on no CUDA."""
    if registry.training_objective(family) is None:
        return PreflightError(f"the {family.name} plugin provides no trainer (no training_objective); "
                              "train a LoRA on a family that has one (`diffusion-engine families`)",
                              code="not_trainable")
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
    return None


def _accelerator_error(
    registry: Registry, family: FamilySpec, hardware: HardwareProfile, device: Device
) -> PreflightError | None:
    """What this machine's accelerator cannot do for the family, whatever the mode."""
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
    if not on_cpu and training_device(hardware, device) == "cpu":
        return PreflightError(
            f"{family.label} LoRA training needs a CUDA GPU (or, with an nf4 base, an Apple or Intel GPU); "
            f"this machine has "
            f"{hardware.device_name} ({hardware.vendor}). Pass device=cpu to train "
            "slowly on the CPU (small models and tests).",
            code="needs_cuda",
        )
    return None


def _mode_error(
    registry: Registry, family: FamilySpec, hardware: HardwareProfile, mode: str, *,
    base_repo: str | None, device: Device,
) -> PreflightError | None:
    """Why the resolved base precision ``mode`` cannot run here, or None."""
    accelerator = training_device(hardware, device)
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
    return mode_requirement_error(mode, hardware, device == "cpu")


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
        if mode in denied or mode_requirement_error(mode, hardware, False) is not None:
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


