"""Compute dtype per component: the denoiser's (the ``dtype`` control), and the text
encoders' and the VAE's where the family's table says fp16 is unsafe for them. Pure.

A family declares fp16 safety per component (``PrecisionRules.fp16_unsafe``). Where the
denoiser computes in fp16 and a text encoder or the VAE may not, that component gets
bf16 where the device has it natively, else fp32, with the table's reason: diffusers' own
Sana recipe is an fp16 transformer beside a bf16 text encoder, and on a T4 or a V100 an fp16
denoiser beside an fp32 encoder beats a whole pipeline in fp32. The memory plan counts each
component at its own width (:func:`weight_factor`), so a combination that does not fit is
refused as any plan is. A component the table keeps in fp32 (``keep_fp32``) stays there.
"""

from __future__ import annotations

from engine.contract.types import FamilySpec
from engine.hardware.profile import HardwareProfile
from engine.policy.resolved import Resolved, auto

#: Bytes per parameter relative to bf16.
DTYPE_FACTOR = {"bf16": 1.0, "fp16": 1.0, "fp32": 2.0}
#: How messages name each component.
LABELS = {"denoiser": "denoiser", "text_encoders": "text encoders", "vae": "VAE"}


def safe_instead(hardware: HardwareProfile) -> str:
    """What an fp16-unsafe component computes in: bf16 where native (a CPU's counts), else fp32."""
    return "bf16" if hardware.native_bf16 or hardware.vendor == "cpu" else "fp32"


def component_dtype(family: FamilySpec, hardware: HardwareProfile, compute: Resolved[str],
                    component: str) -> Resolved[str]:
    """The dtype ``component`` computes in beside a ``compute`` denoiser, with the reason."""
    rules, label = family.precision, LABELS[component]
    kept = next((reason for name, reason in rules.keep_fp32 if name == component), None)
    if kept is not None:
        return auto("fp32", f"the {label} stay in fp32 whatever the compute dtype: {kept}")
    if compute.value == "fp16" and not rules.fp16_safe(component):
        instead = safe_instead(hardware)
        return auto(instead, f"fp16 is unsafe for its {label} ({rules.fp16_reason(component)}): {instead} "
                             f"beside the fp16 {family.pipeline.denoiser_label}")
    return Resolved(compute.value, compute.source, f"the {label} run in the compute dtype")


def weight_factor(family: FamilySpec, hardware: HardwareProfile, dtype: str, component: str) -> float:
    """Bytes per parameter of ``component``'s weights, relative to bf16, beside a ``dtype``
    denoiser (a ``keep_fp32`` component's table size is already its fp32 size)."""
    if family.precision.keeps_fp32(component):
        return DTYPE_FACTOR[dtype]  # the table already sizes it as it is held
    return DTYPE_FACTOR[component_dtype(family, hardware, auto(dtype, ""), component).value]


def others_unsafe(family: FamilySpec, hardware: HardwareProfile) -> str:
    """Where the denoiser runs fp16 beside components that may not: what they run in, and why
    ("" when every component is fp16-safe)."""
    return "; ".join(f"its {LABELS[c]} in {safe_instead(hardware)} ({reason})"
                     for c, reason in family.precision.fp16_unsafe if c != "denoiser")
