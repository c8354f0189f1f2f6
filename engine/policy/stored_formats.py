"""A checkpoint its publisher stored quantised (ComfyUI's ``fp8_scaled``): kept as stored where
the machine computes it, else dequantised to the compute dtype on load, said in the plan.

Torch-free. The format is named by the preflight from the file's headers
(:mod:`engine.preflight.upstream_files`); this module decides what the plan does with it.
"""

from __future__ import annotations

import dataclasses

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.quant import scheme_unsupported_reason
from engine.policy.resolved import Resolved, auto
from engine.policy.scheme_choice import SchemeChoice

#: The engine scheme each upstream format is kept as where the machine computes it.
KEPT_AS: dict[str, str] = {"fp8_scaled": "fp8", "fp8_e4m3fn": "fp8"}


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
    kept = KEPT_AS[fmt]
    why = scheme_unsupported_reason(kept, hardware, dtype)
    if why is None:
        if quant.source == "explicit" and quant.asked != kept:
            raise PreflightError(
                f"quant={quant.asked or 'none'}: the file is stored {fmt} and loads as {kept}; it is not made dense "
                f"or requantised: drop quant, or load the dense file", code="prequantised_model")
        return kept, quant
    if quant.source == "explicit" and quant.asked not in (None, "none"):
        raise PreflightError(
            f"quant={quant.asked}: the file is stored {fmt}, which this machine computes no {kept} for ({why}): it "
            f"loads dequantised to {dtype}; drop quant, or load the dense file to quantise it",
            code="prequantised_model",
        )
    return None, auto(None, f"the file is stored {fmt}; dequantised to {dtype} on load: {why}")


def kept_as_stored(choice: SchemeChoice, fmt: str | None, kept: str | None) -> SchemeChoice:
    """``choice`` with the plan's reason for a stored file kept as stored (``kept``), where one is."""
    if fmt is None or kept is None:
        return choice
    return dataclasses.replace(choice, quant=auto(kept, f"the file is stored {fmt} (float8 weights with their "
                                                        f"scales): kept {kept}, its weights re-laid per row as "
                                                        "torchao tensors on the host"))
