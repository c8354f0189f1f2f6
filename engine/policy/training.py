"""Training precision: which base precisions a run can use, and why not.

Pure: a family, a hardware profile and a request in, a decision out. The
same function answers ``info`` (which modes to advertise) and the start
preflight (which request to refuse), so the two can never disagree: a mode
is advertised exactly when its preflight passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry
from engine.policy.resolved import Resolved, auto, explicit
from engine.types import TRAINING_PRECISIONS, FamilySpec

Device = Literal["auto", "cuda", "cpu"]
DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class TrainingThresholds:
    """Free-memory bands for ``base_precision=auto``, as multiples of the
    family's dense bf16 GB. Starting values; a config may override them."""

    bf16_headroom: float = 1.5
    int8_headroom: float = 1.15


def resolve_training_precision(
    registry: Registry,
    family: FamilySpec,
    hardware: HardwareProfile,
    requested: str,
    *,
    base_repo: str | None = None,
    device: Device = "auto",
    thresholds: TrainingThresholds = TrainingThresholds(),
) -> Resolved[str]:
    """The base precision a run will use. ``auto`` never picks fp8 or mxfp8
    (measured slower than compiled bf16 at LoRA shapes, or riskier)."""
    if requested != "auto":
        return explicit(requested)
    if base_repo and registry.dense_base(family, base_repo) is not None:
        return auto("nf4", "the base is pre-quantised (4-bit); it trains in nf4 only")
    if device == "cpu":
        return auto("bf16", "device=cpu: the base is held dense in bf16 (no 4-bit kernels on CPU)")
    if not hardware.cuda:
        return auto("nf4", f"no CUDA device ({hardware.vendor}): nf4 is the only choice left")
    free = hardware.free_memory_gb
    dense = family.training_dense_gb
    if free is None or dense <= 0:
        return auto("nf4", "free memory or the dense size is unknown: nf4 is the safe choice")
    denied = registry.quant_deny(family, "training")
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
) -> PreflightError | None:
    """The first reason this precision request is doomed on this machine, or None.

    Cheap and CPU-only; called before anything is evicted or loaded.
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
    if mixed_precision == "fp16" and family.training_requires_bf16:
        return PreflightError(
            f"{family.label} trains in bf16; fp16 mixed precision is refused"
            + (f" ({family.fp16_unsafe_reason})" if family.fp16_unsafe_reason else "")
            + ". Use mixed_precision=bf16 on a GPU with native bf16.",
            code="fp16_on_bf16_family",
        )
    if device == "cuda" and not hardware.cuda:
        return PreflightError(
            f"device=cuda but this machine has no CUDA device ({hardware.device_name})",
            code="needs_cuda",
        )
    if not family.base_precision_applies:
        return None  # this trainer ignores base_precision; a leftover value never fails it
    on_cpu = device == "cpu"
    if not on_cpu and hardware.cuda and family.training_requires_bf16 and not hardware.native_bf16:
        fp16_families = [f.name for f in registry.families.values() if not f.training_requires_bf16]
        return PreflightError(
            f"{family.label} LoRA training computes in bf16 whatever the base precision, "
            f"and {hardware.device_name} ({hardware.capability_label}) has no native bf16 "
            "(it needs an Ampere or newer GPU, compute capability 8.0+). Train on a newer GPU"
            + (f", or a family that trains in fp16 ({', '.join(fp16_families)})." if fp16_families else "."),
            code="no_native_bf16",
        )
    if not on_cpu and not hardware.cuda:
        return PreflightError(
            f"{family.label} LoRA training needs a CUDA GPU; this machine has "
            f"{hardware.device_name} ({hardware.vendor}). Pass device=cpu to train "
            "slowly on the CPU (small models and tests).",
            code="needs_cuda",
        )
    mode = resolve_training_precision(
        registry, family, hardware, base_precision,
        base_repo=base_repo, device=device, thresholds=thresholds,
    ).value
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
    return _mode_requirement_error(mode, hardware, on_cpu)


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
    if mode == "fp8" and (on_cpu or not hardware.fp8):
        return PreflightError(
            f"fp8 training needs an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper, "
            f"Blackwell); this is {hardware.device_name} ({hardware.capability_label})",
            code="fp8_unsupported",
        )
    if mode == "mxfp8" and (on_cpu or not hardware.mxfp8):
        return PreflightError(
            f"mxfp8 training needs CUDA and a Blackwell GPU (sm100+); this is "
            f"{hardware.device_name} ({hardware.capability_label})",
            code="mxfp8_unsupported",
        )
    return None
