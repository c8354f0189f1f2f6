"""Transformer weight schemes: how many bytes each keeps, steady and while building.

Factors are fractions of the bf16 transformer's bytes. They sit above the
pure bit ratio because norms, embeddings, modulation and small layers stay
in bf16 and scales are stored alongside. ``transient`` is the peak while
quantising on the fly: the dense weights are loaded first. A pre-quantised
checkpoint loads at its steady size.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from engine.contract.schemes import HOST_QUANTISED, SCHEMES


@dataclass(frozen=True)
class SchemeSize:
    steady: float
    transient: float


#: Each scheme's generic factors, from the scheme table (:data:`engine.contract.schemes.SCHEMES`).
SCHEME_SIZES: Mapping[str, SchemeSize] = MappingProxyType(
    {name: SchemeSize(steady=s.steady, transient=s.transient) for name, s in SCHEMES.items()}
)
#: Schemes the runtime quantises on the host (block by block) and moves to the device
#: already quantised: their device peak is the steady size (bitsandbytes nf4 quantises
#: while loading onto the device instead).
__all__ = ["HOST_QUANTISED", "SCHEME_SIZES", "SchemeSize", "transformer_gb"]


def transformer_gb(
    bf16_gb: float, scheme: str, *, prequantised: bool = False, factor: float | None = None
) -> tuple[float, float]:
    """(steady, transient) GB of a ``bf16_gb`` transformer held in ``scheme``.

    :param factor: the family's own steady factor for ``scheme`` (its table's
        ``quant_factors``), which beats the scheme's generic one.
    """
    size = SCHEME_SIZES[scheme]
    steady = bf16_gb * (size.steady if factor is None else factor)
    return steady, steady if prequantised else bf16_gb * size.transient
