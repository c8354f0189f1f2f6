"""Entry point of the Qwen-Image 2.1 family plugin: registers its table, and sizes an edit's
references to the image asked for.
"""

import math
from collections.abc import Callable
from typing import Any

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION
from engine.contract.types import FamilySpec
from families.qwen_image21.table import QWEN_IMAGE21

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(QWEN_IMAGE21)


@hookimpl
def engine_generate_kwargs(family: FamilySpec, pipeline: object, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The pipeline resizes each reference to ``output_resolution`` squared pixels (1024 by
    default, whatever the image asked for): an edit's references take the area of the image
    asked for, as the engine sizes every edit's inputs (Qwen-Image's ``max_area``)."""
    if family.name != QWEN_IMAGE21.name or "output_resolution" in kwargs:
        return None
    width, height = kwargs.get("width"), kwargs.get("height")
    if not (kwargs.get("image") and width and height):
        return None
    return {**kwargs, "output_resolution": round(math.sqrt(width * height))}
