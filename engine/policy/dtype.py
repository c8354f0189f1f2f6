"""Compute dtype: native bf16 first, fp16 only where the family tolerates it.

A family whose fp16 compute is unsafe (black frames, attention failures) is
never given fp16 silently: it gets fp32 where the fp32 transformer fits the
memory plan, and a refusal otherwise.
"""

from __future__ import annotations

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.cpu_kernel import cpu_dtype
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.choices import DTYPES
from engine.contract.types import FamilySpec


#: Bytes per parameter relative to bf16.
DTYPE_FACTOR = {"bf16": 1.0, "fp16": 1.0, "fp32": 2.0}


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
    if requested == "fp16" and not family.precision.pipeline_fp16_safe():
        raise PreflightError(
            f"fp16 was asked for, but {family.precision.pipeline_fp16_reason()}. Use dtype=auto "
            "(bf16 where native, else fp32).",
            code="fp16_unsafe",
        )
    if requested != "auto":
        return explicit(requested)
    if hardware.vendor == "cpu":
        return cpu_dtype(hardware, fp32_fits=fp32_fits, exact=exact)
    if hardware.native_bf16:
        return auto("bf16", f"native bf16 on {hardware.device_name}")
    if family.precision.pipeline_fp16_safe():
        return auto("fp16", f"no native bf16 on {hardware.device_name}; {family.label} runs in fp16")
    if fp32_fits:
        return auto(
            "fp32",
            f"no native bf16 on {hardware.device_name} and {family.precision.pipeline_fp16_reason()}: fp32",
        )
    raise PreflightError(
        f"{family.label} needs bf16 or fp32 compute ({family.precision.pipeline_fp16_reason()}); "
        f"{hardware.device_name} has no native bf16 and the fp32 model does not fit its "
        "memory. Use a GPU with native bf16 (Ampere or newer).",
        code="no_safe_dtype",
    )
