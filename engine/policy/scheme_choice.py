"""The plan's ``transformer_quant``: the requested or ladder scheme against the base's memory plan.

Torch-free. :func:`engine.policy.quant.resolve_quant_request` says which scheme
the request and the machine allow; this module decides whether the plan takes
it, by comparing the memory plan of the transformer as given (dense, GGUF or
stored pre-quantised) with the memory plan under that scheme. An automatic
scheme is taken only where it improves the plan (a lighter memory mode, or
faster GEMMs on the ``max`` speed tier); an explicit one is taken as asked,
refused where the compatibility table refuses it with the memory mode. When a
scheme is taken, the base's memory plan becomes the fallback's, built if the
quantised build fails at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import PreflightError
from engine.policy.compatibility import pair_refusal
from engine.policy.memory import MemoryEstimate, mode_rank
from engine.policy.resolved import Resolved, auto

#: A memory mode with its estimate (what :func:`engine.policy.memory.plan_memory` returns).
MemoryPlan = tuple[Resolved[str], MemoryEstimate]


@dataclass(frozen=True)
class SchemeChoice:
    """The transformer scheme taken, the memory plan it makes (None: the model
    fits no plan), and the fallback's memory plan where a scheme was taken."""

    quant: Resolved[str | None]
    memory: MemoryPlan | None
    fallback_memory: MemoryPlan | None = None


def choose_transformer_scheme(
    quant: Resolved[str | None],
    *,
    prequantised: str | None,
    base: MemoryPlan | None,
    base_name: str,
    tier: str,
    memory_for: Callable[[str | None], MemoryPlan | None],
    label: str = "transformer",
) -> SchemeChoice:
    """Take ``quant`` (the resolved request) or keep the transformer as given.

    :param prequantised: the scheme the checkpoint is stored in, if any.
    :param base: the memory plan of the transformer as given (None: fits nowhere).
    :param base_name: how reasons name it (``dense`` or ``GGUF``).
    :param memory_for: the memory plan under a scheme, in the plan's dtype
        (None where an automatic memory mode fits nowhere; an explicit one that
        cannot fit raises :class:`PreflightError`).
    """
    if prequantised:
        asked = quant.asked
        if quant.source == "explicit" and asked != prequantised:
            dense = asked in (None, "none")
            raise PreflightError(
                f"quant={'none' if dense else asked}: the {label} is stored pre-quantised as {prequantised} and "
                f"cannot be {'made dense' if dense else f'requantised to {asked}'}; drop quant (it loads as "
                f"{prequantised}) or load the model it was made from",
                code="prequantised_model",
            )
        return SchemeChoice(auto(prequantised, "the checkpoint is stored pre-quantised"), base)
    if quant.source == "explicit":
        chosen = memory_for(quant.value) if quant.value else base
        if not quant.value:
            return SchemeChoice(quant, chosen)
        clash = chosen and pair_refusal("quant", quant.value, "memory", chosen[0].value)
        if clash:
            raise PreflightError(
                f"quant={quant.value} with memory={chosen[0].value}: {clash}. "  # type: ignore[index]
                "Use memory=auto (or another memory mode) or another quant.",
                code="incompatible_options",
            )
        return SchemeChoice(quant, chosen, base)
    if quant.value is None:
        return SchemeChoice(quant, base)
    candidate = memory_for(quant.value)
    if candidate is not None and pair_refusal("quant", quant.value, "memory", candidate[0].value):
        candidate = None  # the asked memory mode cannot carry this scheme: stay as given
    better = candidate is not None and (
        base is None or mode_rank(candidate[0].value) < mode_rank(base[0].value)
    )
    if better:
        mode = candidate[0].value  # type: ignore[index]
        was = base[0].value if base else "not fitting at all"
        return SchemeChoice(
            auto(quant.value, f"the {base_name} {label} plans {was}; {quant.value} plans {mode}. {quant.reason}"),
            candidate, base,
        )
    if candidate is not None and base is not None and tier == "max" and quant.value in ("fp8", "mxfp8", "int8"):
        return SchemeChoice(auto(quant.value, f"max tier: {quant.value} GEMMs for speed. {quant.reason}"), candidate, base)
    where = base[0].value if base else "nowhere"
    return SchemeChoice(
        auto(None, f"the {base_name} {label} plans {where}; quantising would not improve the plan (candidate: {quant.value})"),
        base,
    )
