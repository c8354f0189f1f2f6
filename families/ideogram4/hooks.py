"""Entry point of the Ideogram 4 family plugin: registers its table, and turns the request's
guidance into the pipeline's per-step schedule."""

from collections.abc import Callable
from typing import Any

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION
from engine.contract.types import FamilySpec
from families.ideogram4.table import GUIDANCE, IDEOGRAM4, guidance_schedule

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(IDEOGRAM4)


@hookimpl
def engine_generate_kwargs(family: FamilySpec, pipeline: object, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The model card's guidance (7.0) runs on its schedule, the last three steps polishing at
    3.0, for any step count; any other guidance is held on every step (the pipeline takes one
    of ``guidance_scale`` and ``guidance_schedule``, never both)."""
    if family.name != IDEOGRAM4.name or kwargs.get("guidance_schedule") is not None:
        return None
    guidance, steps = kwargs.get("guidance_scale"), kwargs.get("num_inference_steps")
    if guidance == GUIDANCE and isinstance(steps, int):
        return {**kwargs, "guidance_scale": None, "guidance_schedule": list(guidance_schedule(steps))}
    return {**kwargs, "guidance_schedule": None}
