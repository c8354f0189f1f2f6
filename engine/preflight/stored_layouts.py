"""A denoiser stored in a publisher's own layout, recognised from its safetensors headers.

Some repos store a family's denoiser in a layout diffusers' ``from_pretrained`` reads wrong:
fused attention it does not know is dropped and the modules it expected are random-initialised,
with a log line. The family names such layouts (``QuantRules.stored_layouts``: a tensor-name
ending only that layout has, and the torch function converting it); this module tells, from the
tensor names alone and before anything loads, which one a component folder holds, so the plan
and the status say it and the loader converts it (:mod:`engine.runtime.stored_layouts`).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.contract.types import FamilySpec, StoredLayout


def layout_of_names(family: FamilySpec, names: Iterable[str]) -> StoredLayout | None:
    """The family's stored layout whose marker ends one of ``names``; None: diffusers' own."""
    layouts = family.quantisation.stored_layouts
    if not layouts:
        return None
    names = tuple(names)
    return next((layout for layout in layouts if any(name.endswith(layout.marker) for name in names)), None)

