"""Entry point of the Lumina 2 family plugin: registers its table, and calls its pipeline with
the guidance truncation its model card samples with.
"""

from collections.abc import Callable
from typing import Any

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION
from engine.contract.types import FamilySpec
from families.lumina2.table import CFG_TRUNC_RATIO, LUMINA2

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(LUMINA2)


@hookimpl
def engine_generate_kwargs(family: FamilySpec, pipeline: object, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Guidance over the first quarter of the schedule only (``cfg_trunc_ratio``): the pipeline's
    own default runs it on every step, twice the passes for the model card's image."""
    if family.name != LUMINA2.name or "cfg_trunc_ratio" in kwargs:
        return None
    return {**kwargs, "cfg_trunc_ratio": CFG_TRUNC_RATIO}
