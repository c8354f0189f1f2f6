"""Entry point of the HiDream-I1 family plugin: registers its table, and renders the size asked."""

import math
from collections.abc import Callable
from typing import Any

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION
from engine.contract.types import FamilySpec
from families.hidream.table import HIDREAM

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(HIDREAM)


@hookimpl
def engine_generate_kwargs(family: FamilySpec, pipeline: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``HiDreamImagePipeline`` scales every size asked to the area of its ``default_sample_size``
    (1024 x 1024), keeping the aspect: 512 x 512 comes out 1024 x 1024. The engine renders the
    size asked, as ComfyUI does, by giving the pipeline that area (a hair over it, so its
    floor to a multiple of 16 keeps each side): at 1 MP the call is the pipeline's own."""
    width, height = kwargs.get("width"), kwargs.get("height")
    if family.name != HIDREAM.name or not (width and height):
        return None
    pipeline.default_sample_size = (math.sqrt(width * height) + 1e-6) / pipeline.vae_scale_factor
    return None
