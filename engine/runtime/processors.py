"""A pipeline folder's transformers processors, built so a still-image pipeline loads here.

An edit model's vision-language processor (a tokenizer, an image processor and a
video processor) is saved whole, and transformers builds its video processor only
with torchvision installed. A still-image pipeline never feeds that processor a
video, and transformers' image processors fall back to their PIL backends on
their own, so torchvision is not what the pipeline needs: where the video part is
what cannot be built, the processor is built without it (a subclass whose
sub-processors leave the video one out) and every image call is the library's own.
A processor that cannot be built even so raises the library's first error.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from engine.preflight.pipeline_index import index_file, read_index

#: The sub-processor a still-image pipeline never calls.
VIDEO_PART = "video_processor"


def processor_entries(folder: Path) -> dict[str, str]:
    """The folder's transformers processor components, name -> class name (none
    where its index is missing or unreadable: the loader reports that)."""
    try:
        index = read_index(folder)
    except (OSError, ValueError):
        return {}
    if index is None:
        return {}
    return {name: class_name for name, (library, class_name) in index.components.items()
            if library == "transformers" and class_name.endswith("Processor")}


def build_processor(path: Path, class_name: str) -> Any:
    """The processor saved at ``path``; without its video part where only that part
    needs a library this environment lacks."""
    import transformers

    cls = getattr(transformers, _concrete(path, class_name))
    try:
        return cls.from_pretrained(path)
    except ImportError as exc:
        if VIDEO_PART not in cls.get_attributes():
            raise
        try:
            return without_video(cls).from_pretrained(path)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the library's own first error says what is missing
            raise exc from None


def _concrete(path: Path, class_name: str) -> str:
    """The processor class to build: ``class_name``, or where that is ``AutoProcessor`` (a
    modular block's type hint) the class the folder's ``processor_config.json`` names, where
    it is a transformers processor (else ``AutoProcessor`` itself, as given)."""
    import transformers

    if class_name != "AutoProcessor":
        return class_name
    from engine import stored

    try:
        named = stored.read_json(Path(path) / "processor_config.json").get("processor_class")
    except (OSError, ValueError, AttributeError):
        return class_name
    if isinstance(named, str) and named.endswith("Processor") and hasattr(transformers, named):
        return named
    return class_name


@cache
def without_video(cls: type) -> type:
    """``cls`` with its video sub-processor left out: transformers builds a
    processor's parts from ``get_attributes``, so the video one is never read, and
    the constructor's video argument (None) is dropped with it."""
    kept = [name for name in cls.get_attributes() if name != VIDEO_PART]  # type: ignore[attr-defined]
    if cls.get_attributes()[-1] != VIDEO_PART:  # type: ignore[attr-defined]
        raise ImportError(f"{cls.__name__}'s video processor is not its last part")

    def get_attributes(_: type) -> list[str]:
        return list(kept)

    # The library's own module and name: a pipeline saved with it records the library's class.
    return type(cls.__name__, (cls,), {"get_attributes": classmethod(get_attributes), "__module__": cls.__module__,
                                       "__doc__": f"{cls.__name__} without its video processor."})


def pipeline_processors(root: str) -> dict[str, Any]:
    """Each processor of a local pipeline folder, built here, for diffusers'
    ``from_pretrained`` to take as given components (a hub id: none, diffusers builds them)."""
    folder = Path(root)
    if index_file(folder) is None:
        return {}
    return {name: build_processor(folder / name, class_name)
            for name, class_name in processor_entries(folder).items()}
