"""Entry point of the qwen_image family plugin: registers its table.

Every per-concern hook is answered from the table by the engine's built-in
table plugin; this module adds code only where a table cannot say it.
"""

from collections.abc import Callable

from engine.contract.hookspecs import hookimpl
from engine.contract.types import FamilySpec
from engine.contract.plugin_api import PLUGIN_API_VERSION
from families.qwen_image.table import QWEN_IMAGE


#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once

@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(QWEN_IMAGE)


@hookimpl
def engine_generate_kwargs(family: FamilySpec, pipeline: object, kwargs: dict) -> dict | None:
    """Qwen-Image-Edit's call reads the input's size as a PIL image's
    (``image.size``) to pick its conditioning size (a 1024x1024 area at the
    input's aspect, for the VAE and the vision tower alike), so the engine's
    fitted tensor goes in as the picture it is; the pipeline's own processor
    casts it for the VAE. Other pipelines take the tensor."""
    image = kwargs.get("image")
    if family.name != QWEN_IMAGE.name or "Edit" not in type(pipeline).__name__ or not hasattr(image, "permute"):
        return None  # another family or pipeline, or no tensor to turn into a picture
    from diffusers.image_processor import VaeImageProcessor  # torch-free until a generate: imported here

    [picture] = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(image.float()))
    return {**kwargs, "image": picture}
