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
from pathlib import Path

from engine.contract.types import FamilySpec, StoredLayout
from engine.preflight.headers import tensor_shapes


def layout_of_names(family: FamilySpec, names: Iterable[str]) -> StoredLayout | None:
    """The family's stored layout whose marker ends one of ``names``; None: diffusers' own."""
    layouts = family.quantisation.stored_layouts
    if not layouts:
        return None
    names = tuple(names)
    return next((layout for layout in layouts if any(name.endswith(layout.marker) for name in names)), None)


def layout_of_folder(family: FamilySpec, folder: Path) -> StoredLayout | None:
    """The stored layout of the component at ``folder`` (its safetensors headers read)."""
    if not family.quantisation.stored_layouts:
        return None
    return layout_of_names(family, (name for name, _ in tensor_shapes(sorted(Path(folder).glob("*.safetensors")))))
