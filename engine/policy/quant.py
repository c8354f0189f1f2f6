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

from engine.hardware.profile import NATIVE_BF16_MIN_CAPABILITY, HardwareProfile
from engine.policy.resolved import Resolved, auto, explicit
from engine.policy.quant_filter import INT8_LIKE
from engine.contract.schemes import QUANT_REQUESTS, SCHEMES, TORCHAO_SCHEMES  # noqa: F401  (re-exported)
from engine.contract.types import FamilySpec



def quant_ladder(hardware: HardwareProfile, dtype: str | None = None) -> tuple[str, ...]:
    """Schemes ``auto`` may pick on this machine, best first. nvfp4 only when asked.

    No dense (torchao) quantisation below sm80, on the CPU, or with fp16
    compute: there it runs slowly or not at all (see :func:`scheme_unsupported_reason`).
    """
    if dtype == "fp16":
        return ()
    if hardware.vendor == "nvidia" and hardware.mxfp8:
        ladder: tuple[str, ...] = ("fp8", "mxfp8", "int8")
    elif hardware.vendor == "nvidia" and hardware.fp8:
        ladder = ("fp8", "int8")
    elif hardware.vendor == "nvidia" and _below_sm80(hardware):
        ladder = ()
    elif hardware.vendor in ("nvidia", "rocm"):
        ladder = ("int8",)
    else:
        ladder = ()
    if hardware.consumer and "int8" in ladder:
        # Consumer tensor cores: int8 GEMMs are the fastest and the quality is the best.
        ladder = ("int8", *(s for s in ladder if s != "int8"))
    return ladder


def ladder_order(hardware: HardwareProfile, dtype: str | None = None) -> str:
    """Why :func:`quant_ladder` ranks its schemes as it does here, for the plan's reason."""
    ladder = quant_ladder(hardware, dtype)
    if len(ladder) < 2:
        return ""
    order = " > ".join(ladder)
    if hardware.consumer and ladder[0] == "int8":
        return (f"ranked {order}: on a consumer or workstation card int8 ranks ahead of fp8, "
                "the faster of the two there as measured (GeForce cards run fp8 with fp32 accumulation at half rate)")
    return f"ranked {order} on {hardware.capability_label}: the fastest scheme this generation computes natively first"


def _below_sm80(hardware: HardwareProfile) -> bool:
    return hardware.capability is not None and hardware.capability < NATIVE_BF16_MIN_CAPABILITY


def lift_denials(
    reasons: Mapping[str, tuple[str, ...]], family: FamilySpec, hardware: HardwareProfile
) -> Mapping[str, str]:
    """The inference deny list (``reasons``: each plugin's reason per scheme,
    :meth:`~engine.contract.plugins.Registry.quant_deny_reasons`) less what this
    machine's libraries fix, reasons joined.

    A family's table names, per denied scheme, the capability that lifts the
    deny (``fp8_activation_floor``: torchao's float8 config floors activation
    scales, which the runtime then always sets). The deny and its fix move
    together: without the capability the deny stands. Only the table's own
    deny is lifted: another plugin's deny of the scheme stands, with its reason.
    """
    own = {d.scheme: d.reason for d in family.quantisation.deny("inference")}
    lifting = {
        scheme for scheme, capability in family.quantisation.deny_lifted_by
        if scheme in own and bool(getattr(hardware, capability, False))
    }
    remaining: dict[str, str] = {}
    for scheme, why in reasons.items():
        kept = [r for r in why if scheme not in lifting or r != own[scheme]]
        if kept:
            remaining[scheme] = "; ".join(kept)
    return remaining


def lifted_denials(
    reasons: Mapping[str, tuple[str, ...]], family: FamilySpec, hardware: HardwareProfile
) -> dict[str, str]:
    """Per scheme whose deny :func:`lift_denials` lifts here, why it is safe now."""
    remaining = lift_denials(reasons, family, hardware)
    lifted_by = dict(family.quantisation.deny_lifted_by)
    return {
        scheme: (f"{family.label}'s {scheme} deny is lifted: this machine has {lifted_by[scheme]}, the fix its "
                 f"table names, which is what makes {scheme} safe here")
        for scheme in reasons if scheme not in remaining
    }


def scheme_unsupported_reason(scheme: str, hardware: HardwareProfile, dtype: str | None = None) -> str | None:
    """Why ``scheme`` cannot run here, or None when it can.

    An explicit int8 on the CPU is honoured (weight-only int8 halves host
    RAM and runs), though ``auto`` never picks it there.
    """
    if scheme == "nf4":
        if hardware.vendor != "nvidia":
            return "nf4 (bitsandbytes 4-bit) needs an NVIDIA GPU"
        if not hardware.bitsandbytes_usable:
            return "nf4 needs bitsandbytes, which is not usable here (pip install 'diffusion-engine[nf4]')"
        return None
    if SCHEMES[scheme].backend == "sdnq":
        return None  # torch kernels on any device (the package is checked with the folder)
    if SCHEMES[scheme].backend == "nunchaku":
        return _nunchaku_unsupported(scheme, hardware)
    if not hardware.torchao_functional:
        return f"{scheme} needs a functional torchao (missing, or a stub whose quantize_ does nothing)"
    if hardware.vendor == "nvidia" and _below_sm80(hardware):
        return (
            f"torchao {scheme} needs sm80+ (its int8 / float8 GEMM paths); "
            f"{hardware.device_name} is {hardware.capability_label}"
        )
    if dtype == "fp16":
        return f"torchao {scheme} is built for bf16 compute; this plan computes in fp16"
    needs = SCHEMES[scheme].needs
    if needs is not None and not getattr(hardware, needs):
        return (f"{scheme} needs {SCHEMES[scheme].needs_text}; this is {hardware.device_name} "
                f"({hardware.capability_label})")
    if scheme in INT8_LIKE and hardware.vendor == "mps":
        return f"{scheme} (torchao) is not supported on Apple MPS"
    return None


def _nunchaku_unsupported(scheme: str, hardware: HardwareProfile) -> str | None:
    """Where Nunchaku's kernels run: NVIDIA from Turing, never Hopper; nvfp4 on Blackwell."""
    capability = hardware.capability if hardware.vendor == "nvidia" else None
    needs = SCHEMES[scheme].needs
    if capability is None or capability < (7, 5) or capability[0] == 9 or (needs and not getattr(hardware, needs)):
        return f"{scheme} needs {SCHEMES[scheme].needs_text}; this is {hardware.device_name} ({hardware.capability_label})"
    return None


def resolve_quant_request(
    requested: str,
    hardware: HardwareProfile,
    denied: Mapping[str, str],
    *,
    family_label: str,
    dtype: str | None = None,
    lifted: Mapping[str, str] | None = None,
) -> Resolved[str | None]:
    """The scheme to build (explicit), or the auto candidate, with the reason.

    For ``auto`` the value is the *candidate*: the memory planner adopts it
    only when it beats the dense plan (see :mod:`engine.policy.inference`).
    ``lifted``: schemes the family denies but this machine's libraries make
    safe (:func:`lifted_denials`); a reason choosing one says so.
    """
    lifted = lifted or {}
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
                requested=requested,
            )
        unsupported = scheme_unsupported_reason(requested, hardware, dtype)
        if unsupported:
            return explicit(None, f"{unsupported}; falling back to GGUF/dense", requested=requested)
        return explicit(requested, lifted.get(requested, "requested"))
    if not quant_ladder(hardware, dtype):
        return auto(None, f"no dense quantisation is planned here: {_no_ladder_reason(hardware, dtype)}")
    skipped: list[str] = []
    for scheme in quant_ladder(hardware, dtype):
        why_not = denied.get(scheme) or scheme_unsupported_reason(scheme, hardware, dtype)
        if why_not is None:
            note = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            safe = f"; {lifted[scheme]}" if scheme in lifted else ""
            order = ladder_order(hardware, dtype)
            ranked = f" ({order})" if order else ""
            return auto(scheme, f"{scheme} is the first usable scheme on {hardware.device_name}{ranked}{safe}{note}")
        skipped.append(f"{scheme}: {why_not}")
    return auto(None, "no quantisation scheme is usable here" + (f" ({'; '.join(skipped)})" if skipped else ""))


def _no_ladder_reason(hardware: HardwareProfile, dtype: str | None) -> str:
    if dtype == "fp16":
        return "fp16 compute (torchao schemes are built for bf16)"
    if hardware.vendor == "cpu":
        return "CPU: torchao schemes run slower than dense there (quant=int8 to halve RAM)"
    if hardware.vendor == "nvidia" and _below_sm80(hardware):
        return f"{hardware.capability_label} is below sm80"
    return f"{hardware.vendor}: no torchao scheme runs here"
