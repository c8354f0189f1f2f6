"""Text-encoder precision and residency: decided before loading, with reasons. Pure.

On the families this engine serves the text encoders are often as large as
the denoiser (a 7B vision-language model, T5-XXL), and they run once per
prompt. Two controls keep them from deciding whether a model fits:

``text_encoder_quant`` (none / int8 / fp8 / nvfp4 / nf4): the encoders'
weights held quantised. The runtime quantises them *weight-only* (weights
upcast per layer, activations in the compute dtype): an encoder runs once
per prompt at M = prompt tokens, so there is no GEMM speed to win, and a
weight-only scheme has no activation range to overflow. ``auto`` picks by
capability: fp8 on sm89+, int8 on sm80+ and ROCm, none on the CPU, MPS and
below sm80, none where the family's table denies every scheme or the
encoders are too small to be worth it.

``text_encoder_memory`` (resident / streamed): whether the encoders stay
beside the denoiser or are loaded, run and freed for every prompt, so the
denoiser can stay resident on a card that cannot hold both.
"""

from __future__ import annotations

from engine.hardware.profile import HardwareProfile
from engine.policy.memory import Components, MemoryEstimate, MemoryThresholds, plan_memory
from engine.policy.quant import scheme_unsupported_reason
from engine.policy.resolved import Resolved, auto, explicit
from engine.policy.schemes import SCHEME_SIZES
from engine.types import FamilySpec

#: Text-encoder schemes; ``none`` keeps the compute dtype.
ENCODER_SCHEMES: tuple[str, ...] = ("none", "int8", "fp8", "nvfp4", "nf4")
TEXT_ENCODER_QUANT_REQUESTS: tuple[str, ...] = ("auto", *ENCODER_SCHEMES)
TEXT_ENCODER_MEMORY_REQUESTS: tuple[str, ...] = ("auto", "resident", "streamed")

#: ``auto`` leaves encoders below this many bf16 GB dense: quantising saves
#: too little to be worth the load-time cost (a knob; a config may override).
MIN_AUTO_ENCODER_GB = 1.0


def encoder_denials(family: FamilySpec) -> dict[str, str]:
    """Schemes the family's table denies its text encoders, with the reason."""
    return {deny.scheme: deny.reason for deny in family.text_encoder_quant_deny}


def _ladder(hardware: HardwareProfile) -> tuple[str, ...]:
    """Encoder schemes to try, best first, by capability."""
    if not hardware.cuda or not hardware.torchao_functional:
        return ()
    if hardware.vendor == "nvidia" and hardware.fp8:
        return ("fp8", "int8")
    if hardware.vendor == "rocm" or hardware.native_bf16:
        return ("int8",)
    return ()


def resolve_text_encoder_quant(
    family: FamilySpec, hardware: HardwareProfile, requested: str = "auto", *, encoders_gb: float
) -> Resolved[str]:
    """The encoders' weight scheme, with the reason.

    :param encoders_gb: the encoders' dense bf16 GB (headers, else the table).
    :raises ValueError: ``requested`` is not a known value (the caller turns
        it into a refusal naming the field).
    """
    if requested not in TEXT_ENCODER_QUANT_REQUESTS:
        raise ValueError(
            f"text_encoder_quant {requested!r} is not one of {', '.join(TEXT_ENCODER_QUANT_REQUESTS)}"
        )
    denied = encoder_denials(family)
    if requested == "none":
        return explicit("none", "the encoders run in the compute dtype, as asked")
    if requested != "auto":
        if requested in denied:
            return explicit(
                "none", f"{requested} is denied for {family.label}'s text encoders: {denied[requested]}; "
                "they run in the compute dtype", requested=requested,
            )
        unsupported = scheme_unsupported_reason(requested, hardware)
        if unsupported:
            return explicit("none", f"{unsupported}; the encoders run in the compute dtype", requested=requested)
        return explicit(requested, f"{requested} weight-only encoders, as asked ({_saving(encoders_gb, requested)})")
    ladder = _ladder(hardware)
    if not ladder:
        where = "CPU" if hardware.vendor == "cpu" else f"{hardware.device_name} ({hardware.capability_label})"
        return auto("none", f"{where}: no encoder quantisation is planned here (text_encoder_quant=int8 to halve their memory)")
    if encoders_gb < MIN_AUTO_ENCODER_GB:
        return auto("none", f"the encoders are {encoders_gb:.1f} GB: quantising would save too little")
    skipped = []
    for scheme in ladder:
        why_not = denied.get(scheme) or scheme_unsupported_reason(scheme, hardware)
        if why_not is None:
            note = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            return auto(scheme, f"{scheme} weight-only encoders on {hardware.device_name}: {_saving(encoders_gb, scheme)}; "
                        f"they run once per prompt, so weight-only costs no step time{note}")
        skipped.append(f"{scheme}: {why_not}")
    return auto("none", f"{family.label}'s table denies its encoders every usable scheme ({'; '.join(skipped)})")


def _saving(dense_gb: float, scheme: str) -> str:
    return f"{dense_gb:.1f} GB -> {encoder_gb(dense_gb, scheme):.1f} GB"


def encoder_gb(dense_bf16_gb: float, scheme: str, dtype_factor: float = 1.0) -> float:
    """GB the encoders hold in ``scheme`` (``none``: the compute dtype, by ``dtype_factor``)."""
    if scheme == "none":
        return dense_bf16_gb * dtype_factor
    return dense_bf16_gb * SCHEME_SIZES[scheme].steady


def resolve_text_encoder_memory(
    parts: Components,
    mode: tuple[Resolved[str], MemoryEstimate],
    hardware: HardwareProfile,
    requested: str = "auto",
    thresholds: MemoryThresholds = MemoryThresholds(),
) -> tuple[Resolved[str], tuple[Resolved[str], MemoryEstimate]]:
    """Resident encoders, or streamed ones (load, encode, free per prompt).

    Streaming is planned when the whole pipeline does not fit resident but
    the denoiser and VAE do once the encoders are gone, and the encoders fit
    on their own: the denoiser then stays on the device across images
    instead of being moved on and off for each (model offload) or streamed
    block by block every step. Returns the control and the (possibly re-planned)
    memory mode and estimate.
    """
    if requested not in TEXT_ENCODER_MEMORY_REQUESTS:
        raise ValueError(
            f"text_encoder_memory {requested!r} is not one of {', '.join(TEXT_ENCODER_MEMORY_REQUESTS)}"
        )
    without = Components(
        parts.transformer_gb, parts.transformer_transient_gb, 0.0, parts.vae_gb, parts.quantised
    )
    alone = Components(0.0, 0.0, parts.text_encoders_gb, 0.0)
    if requested == "resident":
        return explicit("resident", "the encoders stay loaded, as asked"), mode
    if requested == "streamed":
        rest = plan_memory(without, hardware, "auto", thresholds)
        if mode[0].source == "explicit" and mode[0].value != "resident":
            return explicit("resident", f"streamed encoders need the rest of the pipeline resident; "
                            f"memory={mode[0].value} was asked", requested="streamed"), mode
        if rest[0].value != "resident":
            return explicit("resident", f"streamed encoders need the rest of the pipeline resident, which "
                            f"does not fit ({rest[0].reason})", requested="streamed"), mode
        return explicit("streamed", f"loaded, run and freed for every prompt, as asked; the rest: {rest[0].reason}"), rest
    if hardware.vendor == "cpu" or hardware.unified_memory:
        return auto("resident", "one memory pool: freeing the encoders after each prompt gains nothing"), mode
    if mode[0].value == "resident":
        return auto("resident", "the whole pipeline fits resident"), mode
    rest = plan_memory(without, hardware, "auto", thresholds)
    own = plan_memory(alone, hardware, "auto", thresholds)
    if rest[0].value == "resident" and own[0].value == "resident":
        return auto(
            "streamed",
            f"the encoders ({parts.text_encoders_gb:.1f} GB) do not fit beside the denoiser "
            f"({parts.transformer_gb:.1f} GB), which fits resident without them: they are loaded, "
            "run and freed for every prompt, and the denoiser is never offloaded",
        ), rest
    return auto("resident", f"streaming would not make the denoiser resident ({mode[0].value} either way)"), mode

