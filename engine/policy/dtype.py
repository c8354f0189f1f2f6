"""Compute dtype: native bf16 first, fp16 only where the family's denoiser tolerates it.

A family whose denoiser is fp16-unsafe (black frames, attention failures) is never
given fp16 silently: it gets fp32 where the fp32 transformer fits the memory plan, and
a refusal otherwise. A family whose text encoders or VAE alone are fp16-unsafe computes
its denoiser in fp16 with those components in bf16 or fp32
(:mod:`engine.policy.component_dtypes`).
"""

from __future__ import annotations

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.component_dtypes import DTYPE_FACTOR, others_unsafe
from engine.policy.cpu_kernel import cpu_dtype
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.choices import DTYPES
from engine.contract.types import FamilySpec

__all__ = ["DTYPE_FACTOR", "resolve_dtype"]


def resolve_dtype(
    family: FamilySpec,
    hardware: HardwareProfile,
    requested: str,
    *,
    fp32_fits: bool,
    exact: bool = True,
) -> Resolved[str]:
    """The compute dtype, or a :class:`PreflightError` raised for a doomed request.

    :param fp32_fits: whether the memory plan can hold the model in fp32
        (decided by the caller, who owns the memory arithmetic).
    :param exact: no speed tier was asked for (the off tier: images equal stock diffusers'),
        so a CPU computes in fp32 where it fits; a tier takes its native bf16.
    """
    if requested not in DTYPES:
        raise PreflightError(
            f"dtype {requested!r} is not one of {', '.join(DTYPES)}", code="invalid_dtype"
        )
    if requested == "bf16" and hardware.cuda and not hardware.native_bf16:
        raise PreflightError(
            f"bf16 was asked for, but {hardware.device_name} ({hardware.capability_label}) "
            "has no native bf16 (Ampere or newer needed; torch would emulate it slowly). "
            "Use dtype=auto.",
            code="bf16_unsupported",
        )
    rules = family.precision
    if requested == "fp16" and not rules.fp16_safe("denoiser"):
        raise PreflightError(
            f"fp16 was asked for, but {rules.fp16_reason('denoiser')}. Use dtype=auto "
            "(bf16 where native, else fp32).",
            code="fp16_unsafe",
        )
    others = others_unsafe(family, hardware)
    if requested != "auto":
        return explicit(requested, f"requested; {others}" if requested == "fp16" and others else "requested")
    if hardware.vendor == "cpu":
        return cpu_dtype(hardware, fp32_fits=fp32_fits, exact=exact)
    if hardware.native_bf16:
        return auto("bf16", f"native bf16 on {hardware.device_name}")
    if rules.fp16_safe("denoiser"):
        beside = f", {others}" if others else ""
        return auto("fp16", f"no native bf16 on {hardware.device_name}; {family.label} runs in fp16{beside}")
    if fp32_fits:
        return auto(
            "fp32",
            f"no native bf16 on {hardware.device_name} and {rules.fp16_reason('denoiser')}: fp32",
        )
    raise PreflightError(
        f"{family.label} needs bf16 or fp32 compute ({rules.fp16_reason('denoiser')}); "
        f"{hardware.device_name} has no native bf16 and the fp32 model does not fit its "
        "memory. Use a GPU with native bf16 (Ampere or newer).",
        code="no_safe_dtype",
    )
