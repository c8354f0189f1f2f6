"""A checkpoint its publisher stored quantised: kept in the engine's scheme for it where the
machine computes that scheme, else dequantised to the compute dtype on load, said in the plan.

Torch-free. The format is named by the preflight from the file's headers
(:mod:`engine.preflight.upstream_files`); this module decides what the plan does with it.
"""

from __future__ import annotations

import dataclasses

from engine.errors import PreflightError
from engine.contract.types import FamilySpec
from engine.hardware.profile import HardwareProfile
from engine.policy.plan import ModelFacts
from engine.policy.quant import scheme_unsupported_reason
from engine.policy.resolved import Resolved, auto
from engine.policy.scheme_choice import SchemeChoice

#: The engine scheme each upstream format is kept as where the machine computes it (a file of
#: several formats, ``mixed (...)``, is dequantised: the engine lays one scheme per denoiser).
KEPT_AS: dict[str, str] = {
    "fp8_scaled": "fp8", "fp8_e4m3fn": "fp8", "float8_e4m3fn": "fp8", "bfl_fp8r": "fp8",
    "int8_tensorwise": "int8", "int8_convrot": "int8_convrot", "nvfp4": "nvfp4", "bfl_nvfp4": "nvfp4", "mxfp8": "mxfp8",
}
#: Formats diffusers' own quantizer loads (``bfl``): kept packed on any machine, dequantised by
#: diffusers in each forward where the machine has no kernel for them.
THROUGH_DIFFUSERS: dict[str, str] = {"bfl_fp8r": "bfl", "bfl_nvfp4": "bfl"}
#: How each kept format's weights reach the engine's scheme, for the plan's reason.
_HOW = {
    "int8_convrot": "its int8 codes re-laid per row as torchao int8, still rotated (ConvRot): the inputs are "
                    "rotated as they arrive",
    "int8_tensorwise": "its int8 codes re-laid per row as torchao int8",
    "nvfp4": "its fp4 codes and block scales re-laid as torchao nvfp4",
    "mxfp8": "its codes and block scales re-laid as torchao mxfp8",
}


def stored_choice(model: ModelFacts, stored: str | None, quant: Resolved[str | None], hardware: HardwareProfile,
                  dtype: str, family: FamilySpec) -> tuple[str | None, Resolved[str | None]]:
    """:func:`stored_format_choice` for ``model``, after refusing a model stored pre-quantised
    in a scheme this machine cannot compute (:func:`refuse_stored_scheme`)."""
    refuse_stored_scheme(model.prequantised_scheme, hardware, dtype, family.pipeline.denoiser_label)
    return stored_format_choice(model.stored_format, stored, quant, hardware, dtype)


def refuse_stored_scheme(scheme: str | None, hardware: HardwareProfile, dtype: str, label: str) -> None:
    """Refuse a model stored pre-quantised (a folder, by ``quantize`` or another library) in a
    scheme this machine cannot compute: loading it would fail after the resident model was gone."""
    why = scheme_unsupported_reason(scheme, hardware, dtype) if scheme else None
    if why is not None:
        raise PreflightError(
            f"the {label} is stored pre-quantised as {scheme}, which this machine cannot compute ({why}); "
            f"load the dense model, or run on a machine that computes {scheme}",
            code="stored_scheme_unsupported",
        )


def stored_format_choice(fmt: str | None, stored: str | None, quant: Resolved[str | None], hardware: HardwareProfile,
                         dtype: str) -> tuple[str | None, Resolved[str | None]]:
    """(the scheme the plan treats the file as stored in, the ``transformer_quant`` to resolve);
    ``stored`` and ``quant`` as they are where the file is no publisher's format (``fmt`` None).

    Kept: the file loads as the engine's ``fp8`` (its codes re-laid per row as torchao tensors),
    and an explicit other ``--quant`` is refused as for any pre-quantised model. Dequantised
    where the machine computes no fp8: the plan weighs it as the dense model, and an explicit
    scheme is refused (re-quantising a dequantised fp8 file adds a second rounding)."""
    if fmt is None:
        return stored, quant
    kept = KEPT_AS.get(fmt)
    why = scheme_unsupported_reason(kept, hardware, dtype) if kept else "its layers are stored in several formats"
    if why is None or fmt in THROUGH_DIFFUSERS:
        if quant.source == "explicit" and quant.asked != kept:
            raise PreflightError(
                f"quant={quant.asked or 'none'}: the file is stored {fmt} and loads as {kept}; it is not made dense "
                f"or requantised: drop quant, or load the dense file", code="prequantised_model")
        return kept, quant
    if quant.source == "explicit" and quant.asked not in (None, "none"):
        raise PreflightError(
            f"quant={quant.asked}: the file is stored {fmt}, which this machine does not compute as stored ({why}): "
            f"it loads dequantised to {dtype}; drop quant, or load the dense file to quantise it",
            code="prequantised_model",
        )
    return None, auto(None, f"the file is stored {fmt}; dequantised to {dtype} on load: {why}")


def kept_as_stored(choice: SchemeChoice, fmt: str | None, kept: str | None, hardware: HardwareProfile,
                   dtype: str) -> SchemeChoice:
    """``choice`` with the plan's reason for a stored file kept as stored (``kept``), where one is."""
    if fmt is None or kept is None:
        return choice
    if fmt in THROUGH_DIFFUSERS:
        why = scheme_unsupported_reason(kept, hardware, dtype)
        how = (f"diffusers dequantises each layer to {dtype} as it runs ({why})" if why else
               "diffusers computes it with its kernels where the card has them")
        reason = f"the file is stored {fmt}: loaded through diffusers' {THROUGH_DIFFUSERS[fmt]} quantizer, its layers kept packed; {how}"
    else:
        how = _HOW.get(fmt, "float8 weights with their scales: kept fp8, its weights re-laid per row as torchao tensors")
        reason = f"the file is stored {fmt} ({how}) on the host"
    return dataclasses.replace(choice, quant=auto(kept, reason))
