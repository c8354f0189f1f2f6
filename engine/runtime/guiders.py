"""Sampling settings a pipeline's components hold rather than its call: the guidance scale of a
diffusers guider (``guider.guidance_scale``)."""

from __future__ import annotations

from typing import Any

from engine.errors import EngineError


def set_component_guidance(pipe: Any, spelling: str, guidance: float) -> None:
    """Guidance held by a pipeline component (``guider.guidance_scale``: a diffusers guider),
    set for the next call: the guider is replaced by a copy with the new scale."""
    name, attribute = spelling.split(".", 1)
    component = getattr(pipe, name, None)
    if component is None and guidance <= 1:  # a distilled checkpoint without a guider, and none asked
        return
    if component is None or not hasattr(component, "new"):
        raise EngineError(f"the pipeline has no {name} guider to take its guidance ({spelling})",
                          code="invalid_request")
    if getattr(component, attribute, None) != guidance:
        setattr(pipe, name, component.new(**{attribute: guidance}))
