"""Text-encoder precision and residency: decided before loading, with reasons. Pure.

On the families this engine serves the text encoders are often as large as
the denoiser (a 7B vision-language model, T5-XXL), and they run once per
prompt. Two controls keep them from deciding whether a model fits:

``text_encoder_quant`` (the rows of :data:`engine.contract.schemes.ENCODER_SCHEME_ROWS`):
``fp8`` stores the Linear weights in fp8 and upcasts them layer by layer
(plain tensors: it survives offload and streaming); the torchao modes
``fp8_dynamic`` (sm89+), ``int8`` (sm80+) and ``nvfp4`` (Blackwell) are
tensor subclasses that reject ``Module.to``, so a plan that moves the
encoders (offload, streaming) runs layerwise fp8 instead, saying so
(:func:`movable_encoder_quant`); ``nf4`` is bitsandbytes at load. Every
quantised mode needs a CUDA GPU with native bf16; an explicit ``fp8`` or
``int8`` on the CPU is honoured (it halves host RAM). int8 runs only for a
family with a keep-in-bf16 schedule (``text_encoder_int8_keep``); elsewhere
it runs as layerwise fp8 and the record says fp8 is the effective mode.
``auto`` takes layerwise fp8 on a CUDA GPU with native bf16, none on the
CPU, MPS and older cards, where the family's table denies it, or where the
encoders are too small to be worth it.

``text_encoder_memory`` (resident / streamed / host): whether the encoders stay
beside the denoiser, are loaded, run and freed for every prompt, so the
denoiser can stay resident on a card that cannot hold both, or stay in host
memory and run on the CPU, where they do not fit the card even alone (a T4's
fp32 UMT5, 22.8 GB, beside a 5.7 GB fp32 video denoiser).

Pre-cast encoders: a text encoder downloaded already cast (a T5-XXL stored
in ``float8_e4m3fn``, the file people fetch instead of the dense one) is
recognised from its safetensors header dtypes (:func:`precast_encoders`),
sized at what it stores (1 byte a parameter), and planned as ``fp8``
without a second quantisation where the machine has fp8. Where it has not,
it is upcast to the compute dtype at load (torch casts fp8 on any device)
and sized dense, so the memory rule refuses it before anything is evicted
if that does not fit; the reason says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.memory import Components, MemoryEstimate, MemoryThresholds, base_overhead_gb, plan_memory
from engine.policy.quant import scheme_unsupported_reason
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.choices import TEXT_ENCODER_MEMORY_REQUESTS, TEXT_ENCODER_QUANT_REQUESTS
from engine.contract.schemes import ENCODER_SCHEME_ROWS, ENCODER_SCHEMES
from engine.contract.types import FamilySpec

#: ``auto`` leaves encoders below this many bf16 GB dense: quantising saves
#: too little to be worth the load-time cost (a knob; a config may override).
MIN_AUTO_ENCODER_GB = 1.0


#: safetensors dtype -> the encoder scheme a checkpoint stored in it is pre-cast to.
PRECAST_DTYPES: dict[str, str] = {"F8_E4M3": "fp8"}
#: Tensor names (last part) that mark a *scaled* fp8 file: its weights need them.
SCALE_TENSORS = frozenset({"scale_weight", "scale_input", "weight_scale", "input_scale", "scaled_fp8"})
#: The torch names of those dtypes, for reasons a user reads.
_TORCH_NAMES: dict[str, str] = {"F8_E4M3": "float8_e4m3fn"}


@dataclass(frozen=True)
class PrecastEncoders:
    """Text encoders whose checkpoint is stored already cast (most parameters in ``dtype``)."""

    scheme: str
    #: The safetensors dtype most parameters are stored in.
    dtype: str
    #: GB the encoder files hold as stored (their header byte ranges).
    stored_gb: float
    #: Share of the encoders' parameters stored in ``dtype``.
    share: float
    #: The encoder folders stored in ``dtype``.
    encoders: tuple[str, ...] = ()


def precast_encoders(encoders: Mapping[str, Iterable[tuple[str, str, int, int]]]) -> PrecastEncoders | None:
    """The pre-cast scheme of a pipeline's encoders, or None for dense ones.

    :param encoders: per encoder folder, its tensors ``(name, dtype, elements,
        bytes)`` (from :func:`engine.preflight.headers.tensor_storage`).
    :raises PreflightError: a *scaled* fp8 file (per-layer scale tensors beside
        the weights), whose weights mean nothing without scales the loader
        would drop.

    An encoder is pre-cast when most of its parameters are stored in an fp8
    dtype (norms, biases and embeddings commonly stay bf16 / fp32 in such
    files); a small dense encoder beside it (CLIP-L beside an fp8 T5) stays
    as stored too, as the plan holds every encoder in one scheme.
    """
    tables = {name: list(tensors) for name, tensors in encoders.items()}
    entries = [entry for tensors in tables.values() for entry in tensors]
    for dtype, scheme in PRECAST_DTYPES.items():
        cast = sorted(
            name for name, tensors in tables.items()
            if 2 * sum(n for _, kind, n, _ in tensors if kind == dtype) > sum(n for _, _, n, _ in tensors) > 0
        )
        for name in cast:
            scales = [key for key, *_ in tables[name] if key.rsplit(".", 1)[-1] in SCALE_TENSORS]
            if scales:
                raise PreflightError(
                    f"{name} is a scaled {_TORCH_NAMES.get(dtype, dtype)} checkpoint (scale tensors such as "
                    f"{scales[0]!r} beside its weights), which this engine does not load: its weights are wrong "
                    "without them. Put the plain (unscaled) fp8 file or the dense encoder in that folder",
                    code="unsupported_encoder_checkpoint",
                )
        if cast:
            total = sum(n for _, _, n, _ in entries)
            share = sum(n for _, kind, n, _ in entries if kind == dtype) / total
            return PrecastEncoders(scheme, dtype, sum(size for *_, size in entries) / 1e9, share, tuple(cast))
    return None


def encoder_denials(family: FamilySpec) -> dict[str, str]:
    """Schemes the family's table denies its text encoders, with the reason."""
    return {deny.scheme: deny.reason for deny in family.quantisation.text_encoder_deny}


def encoder_unsupported_reason(scheme: str, hardware: HardwareProfile, *, explicit_request: bool = False) -> str | None:
    """Why the encoders cannot be held in ``scheme`` here, or None.

    ``explicit_request``: an explicit ``fp8`` or ``int8`` on the CPU is honoured.
    """
    row = ENCODER_SCHEME_ROWS[scheme]
    if row.build == "dense":
        return None
    if row.build == "bitsandbytes":
        return scheme_unsupported_reason("nf4", hardware)
    if explicit_request and hardware.vendor == "cpu" and scheme in ("fp8", "int8"):
        return None if hardware.torchao_functional or scheme == "fp8" else \
            "int8 needs a functional torchao (missing, or a stub whose quantize_ does nothing)"
    if not hardware.cuda or not hardware.native_bf16:
        where = "the CPU" if hardware.vendor == "cpu" else f"{hardware.device_name} ({hardware.capability_label})"
        return f"{scheme} text encoders need a CUDA GPU with native bf16 (sm80+); this is {where}"
    if row.build == "torchao" and not hardware.torchao_functional:
        return f"{scheme} needs a functional torchao (missing, or a stub whose quantize_ does nothing)"
    if row.needs is not None and not getattr(hardware, row.needs):
        return f"{scheme} needs {row.needs_text}; this is {hardware.device_name} ({hardware.capability_label})"
    return None


def movable_encoder_quant(chosen: Resolved[str], memory_mode: str, encoder_memory: str,
                          hardware: HardwareProfile) -> Resolved[str]:
    """``chosen``, or layerwise fp8 where the plan moves the encoders and ``chosen`` is a
    torchao mode (its tensor subclasses reject ``Module.to``)."""
    moved = memory_mode != "resident" or encoder_memory == "streamed"
    if not moved or ENCODER_SCHEME_ROWS[str(chosen.value)].build != "torchao":
        return chosen
    why = (f"{chosen.value} is a torchao tensor subclass, which the {memory_mode if memory_mode != 'resident' else 'streamed'} "
           "encoders cannot be moved in")
    if encoder_unsupported_reason("fp8", hardware, explicit_request=chosen.source == "explicit") is None:
        return Resolved("fp8", chosen.source, f"{why}: layerwise fp8 (weights stored in fp8, upcast per layer) "
                        "instead", chosen.requested if chosen.source == "explicit" else None)
    return Resolved("none", chosen.source, f"{why}; they run in the compute dtype",
                    chosen.requested if chosen.source == "explicit" else None)


def resolve_text_encoder_quant(
    family: FamilySpec, hardware: HardwareProfile, requested: str = "auto", *, encoders_gb: float,
    precast: PrecastEncoders | None = None,
) -> Resolved[str]:
    """The encoders' weight scheme, with the reason.

    :param encoders_gb: the encoders' dense bf16 GB (headers, else the table).
    :param precast: how the encoder files are stored, when pre-cast.
    :raises ValueError: ``requested`` is not a known value (the caller turns
        it into a refusal naming the field).
    """
    if requested not in TEXT_ENCODER_QUANT_REQUESTS:
        raise ValueError(
            f"text_encoder_quant {requested!r} is not one of {', '.join(TEXT_ENCODER_QUANT_REQUESTS)}"
        )
    if precast is None:
        return _resolve_dense(family, hardware, requested, encoders_gb)
    which = ", ".join(precast.encoders) or "the encoders"
    stored = (f"pre-cast checkpoint: {which} stored in {_TORCH_NAMES.get(precast.dtype, precast.dtype)} "
              f"({precast.share:.0%} of the encoders' parameters; {precast.stored_gb:.2f} GB as stored)")
    why_not = encoder_denials(family).get(precast.scheme) or encoder_unsupported_reason(precast.scheme, hardware)
    if requested in ("auto", precast.scheme) and why_not is None:
        make = auto if requested == "auto" else explicit
        return make(precast.scheme, f"{stored}; held as stored, not quantised again")
    chosen = _resolve_dense(family, hardware, requested, encoders_gb)
    cause = f"{why_not}: upcast" if why_not and requested in ("auto", precast.scheme) else "upcast"
    return replace(chosen, reason=f"{stored}; {cause} to the compute dtype at load, "
                   f"sized dense ({encoders_gb:.2f} GB bf16); {chosen.reason}")


def encoder_gb_as_planned(dense_bf16_gb: float, scheme: str, dtype_factor: float,
                          precast: PrecastEncoders | None) -> float:
    """GB the encoders hold as planned: as stored when the plan keeps a pre-cast
    checkpoint's own scheme, else :func:`encoder_gb`."""
    if precast is not None and scheme == precast.scheme:
        return precast.stored_gb
    return encoder_gb(dense_bf16_gb, scheme, dtype_factor)


def _resolve_dense(family: FamilySpec, hardware: HardwareProfile, requested: str, encoders_gb: float) -> Resolved[str]:
    """The scheme for dense encoder weights (the rule before pre-cast checkpoints)."""
    denied = encoder_denials(family)
    if requested == "none":
        return explicit("none", "the encoders run in the compute dtype, as asked")
    if requested != "auto":
        if requested in denied:
            return explicit(
                "none", f"{requested} is denied for {family.label}'s text encoders: {denied[requested]}; "
                "they run in the compute dtype", requested=requested,
            )
        unsupported = encoder_unsupported_reason(requested, hardware, explicit_request=True)
        if unsupported:
            return explicit("none", f"{unsupported}; the encoders run in the compute dtype", requested=requested)
        if requested == "int8" and family.quantisation.text_encoder_int8_keep is None:
            no_schedule = (f"{family.label} has no keep-in-bf16 schedule for int8 text encoders "
                           "(text_encoder_int8_keep)")
            if "fp8" not in denied and encoder_unsupported_reason("fp8", hardware, explicit_request=True) is None:
                return explicit("fp8", f"{no_schedule}: fp8 is the effective mode (layerwise, "
                                f"{_saving(encoders_gb, 'fp8')})", requested="int8")
            return explicit("none", f"{no_schedule}; they run in the compute dtype", requested="int8")
        return explicit(requested, f"{requested} encoders, as asked ({_saving(encoders_gb, requested)})")
    if not hardware.cuda or not hardware.native_bf16:
        where = "CPU" if hardware.vendor == "cpu" else f"{hardware.device_name} ({hardware.capability_label})"
        return auto("none", f"{where}: no encoder quantisation is planned here (text_encoder_quant=fp8 to halve their memory)")
    if encoders_gb < MIN_AUTO_ENCODER_GB:
        return auto("none", f"the encoders are {encoders_gb:.1f} GB: quantising would save too little")
    if "fp8" in denied:
        return auto("none", f"{family.label}'s table denies its encoders fp8: {denied['fp8']}")
    return auto("fp8", f"fp8 encoders on {hardware.device_name}: {_saving(encoders_gb, 'fp8')}, weights stored in "
                "fp8 and upcast layer by layer; they run once per prompt, so it costs no step time")


def _saving(dense_gb: float, scheme: str) -> str:
    return f"{dense_gb:.1f} GB -> {encoder_gb(dense_gb, scheme):.1f} GB"


def encoder_gb(dense_bf16_gb: float, scheme: str, dtype_factor: float = 1.0) -> float:
    """GB the encoders hold in ``scheme`` (``none``: the compute dtype, by ``dtype_factor``)."""
    if scheme == "none":
        return dense_bf16_gb * dtype_factor
    return dense_bf16_gb * ENCODER_SCHEME_ROWS[scheme].steady


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
    without = replace(parts, text_encoders_gb=0.0)
    alone = Components(0.0, 0.0, parts.text_encoders_gb, 0.0)
    if requested == "resident":
        return explicit("resident", "the encoders stay loaded, as asked"), mode
    one_pool = hardware.vendor == "cpu" or hardware.unified_memory
    if requested in ("streamed", "host"):
        if one_pool and requested == "host":
            return explicit("resident", "one memory pool: the encoders are in host memory already",
                            requested="host"), mode
        rest = plan_memory(without, hardware, "auto", thresholds)
        if mode[0].source == "explicit" and mode[0].value != "resident":
            return explicit("resident", f"{requested} encoders need the rest of the pipeline resident; "
                            f"memory={mode[0].value} was asked", requested=requested), mode
        if rest[0].value != "resident":
            return explicit("resident", f"{requested} encoders need the rest of the pipeline resident, which "
                            f"does not fit ({rest[0].reason})", requested=requested), mode
        done = ("loaded, run and freed for every prompt" if requested == "streamed"
                else "kept in host memory and run on the CPU for every prompt")
        return explicit(requested, f"{done}, as asked; the rest: {rest[0].reason}"), rest
    if one_pool:
        return auto("resident", "one memory pool: freeing the encoders after each prompt gains nothing"), mode
    if mode[0].value == "resident":
        return auto("resident", "the whole pipeline fits resident"), mode
    rest = plan_memory(without, hardware, "auto", thresholds)
    # Alone on the device the encoders hold their weights and the base overhead only.
    own = plan_memory(alone, hardware, "auto", replace(thresholds, overhead_gb=base_overhead_gb(thresholds)))
    if rest[0].value == "resident" and own[0].value == "resident":
        return auto(
            "streamed",
            f"the encoders ({parts.text_encoders_gb:.1f} GB) do not fit beside the denoiser "
            f"({parts.transformer_gb:.1f} GB), which fits resident without them: they are loaded, "
            "run and freed for every prompt, and the denoiser is never offloaded",
        ), rest
    if rest[0].value == "resident":  # the encoders do not fit the card even alone: they stay on the host
        return auto(
            "host",
            f"the encoders ({parts.text_encoders_gb:.1f} GB) do not fit the card even alone "
            f"({thresholds.resident_fraction:g} x its {own[1].budget_gb:.1f} GB budget); they stay in host "
            "memory and run on the CPU once per prompt, and the "
            f"denoiser ({parts.transformer_gb:.1f} GB) stays resident on the card, never streamed",
        ), rest
    return auto("resident", f"streaming would not make the denoiser resident ({mode[0].value} either way)"), mode

