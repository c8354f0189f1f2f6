"""Entry point of the HunyuanImage 2.1 family plugin: registers its table, and hands a guidance
the base cannot take as ``distilled_guidance_scale`` to its guiders."""

import weakref
from collections.abc import Callable
from typing import Any

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION
from engine.contract.types import FamilySpec
from families.hunyuan_image.table import GUIDANCE, GUIDERS, HUNYUAN_IMAGE

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once

#: Each loaded pipeline's guiders as its repo made them, kept while the pipeline lives.
_REPO_GUIDERS: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(HUNYUAN_IMAGE)


@hookimpl
def engine_generate_kwargs(family: FamilySpec, pipeline: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The distilled model embeds ``distilled_guidance_scale``; the base ignores it and guides
    with its repo's guiders (real CFG at their own scale). A guidance asked other than the
    default is set on those guiders (copies: the loaded pipeline's own are not changed), so
    ``--guidance`` steers the base too; the default runs them as the repo made them."""
    if family.name != HUNYUAN_IMAGE.name or pipeline.transformer.config.guidance_embeds:
        return None
    own = _REPO_GUIDERS.setdefault(pipeline, {name: getattr(pipeline, name, None) for name in GUIDERS})
    guidance = kwargs.get("distilled_guidance_scale")
    for name, guider in own.items():
        if guider is not None:
            asked = guidance is not None and guidance != GUIDANCE
            setattr(pipeline, name, guider.new(guidance_scale=guidance) if asked else guider)
    return None
