"""Transformer weight quantisation: which scheme, by capability and deny lists.

``auto`` walks a ladder ordered by what the card runs fastest, skipping every
scheme any plugin denies for the family and every scheme this machine cannot
run. An explicit request for a denied or unsupported scheme resolves to *no
scheme*, with the reason: the caller then falls back (to the GGUF file if one
was given, else to the dense transformer), never to a render that is known to
come out black.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.hardware.profile import HardwareProfile
from engine.policy.resolved import Resolved, auto, explicit

QUANT_REQUESTS: tuple[str, ...] = ("auto", "none", "int8", "fp8", "mxfp8", "nvfp4", "nf4")


def quant_ladder(hardware: HardwareProfile) -> tuple[str, ...]:
    """Schemes ``auto`` may pick on this machine, best first. nvfp4 only when asked."""
    if hardware.vendor == "nvidia" and hardware.mxfp8:
        ladder: tuple[str, ...] = ("fp8", "mxfp8", "int8")
    elif hardware.vendor == "nvidia" and hardware.fp8:
        ladder = ("fp8", "int8")
    elif hardware.vendor in ("nvidia", "rocm", "cpu"):
        ladder = ("int8",)
    else:
        ladder = ()
    if hardware.consumer and "int8" in ladder:
        # Consumer tensor cores: int8 GEMMs are the fastest and the quality is the best.
        ladder = ("int8", *(s for s in ladder if s != "int8"))
    return ladder


def scheme_unsupported_reason(scheme: str, hardware: HardwareProfile) -> str | None:
    """Why ``scheme`` cannot run here, or None when it can."""
    if scheme == "nf4":
        if hardware.vendor != "nvidia":
            return "nf4 (bitsandbytes 4-bit) needs an NVIDIA GPU"
        if not hardware.bitsandbytes_usable:
            return "nf4 needs bitsandbytes, which is not usable here (pip install 'diffusion-engine[nf4]')"
        return None
    if not hardware.torchao_functional:
        return f"{scheme} needs a functional torchao (missing, or a stub whose quantize_ does nothing)"
    if scheme == "fp8" and not hardware.fp8:
        return f"fp8 needs an NVIDIA GPU of capability 8.9+; this is {hardware.device_name} ({hardware.capability_label})"
    if scheme in ("mxfp8", "nvfp4") and not hardware.mxfp8:
        return f"{scheme} needs a Blackwell GPU (sm100+); this is {hardware.device_name} ({hardware.capability_label})"
    if scheme == "int8" and hardware.vendor == "mps":
        return "int8 (torchao) is not supported on Apple MPS"
    return None


def resolve_quant_request(
    requested: str,
    hardware: HardwareProfile,
    denied: Mapping[str, str],
    *,
    family_label: str,
) -> Resolved[str | None]:
    """The scheme to build (explicit), or the auto candidate, with the reason.

    For ``auto`` the value is the *candidate*: the memory planner adopts it
    only when it beats the dense plan (see :mod:`engine.policy.inference`).
    """
    if requested not in QUANT_REQUESTS:
        raise ValueError(f"quant {requested!r} is not one of {', '.join(QUANT_REQUESTS)}")
    if requested == "none":
        return explicit(None, "no quantisation requested")
    if requested != "auto":
        if requested in denied:
            return explicit(
                None,
                f"{requested} is denied for {family_label}: {denied[requested]}; "
                "falling back to the GGUF file if given, else the dense transformer",
            )
        unsupported = scheme_unsupported_reason(requested, hardware)
        if unsupported:
            return explicit(None, f"{unsupported}; falling back to GGUF/dense")
        return explicit(requested)
    skipped = []
    for scheme in quant_ladder(hardware):
        why_not = denied.get(scheme) or scheme_unsupported_reason(scheme, hardware)
        if why_not is None:
            note = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            return auto(scheme, f"{scheme} is the first usable scheme on {hardware.device_name}{note}")
        skipped.append(f"{scheme}: {why_not}")
    return auto(None, "no quantisation scheme is usable here" + (f" ({'; '.join(skipped)})" if skipped else ""))
