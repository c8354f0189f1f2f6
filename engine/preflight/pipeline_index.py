"""A pipeline folder's index, classic or modular, read as one shape.

diffusers writes ``model_index.json`` beside a ``DiffusionPipeline``'s components
(``name: [library, class]``) and ``modular_model_index.json`` beside a
``ModularPipeline``'s (``name: [library, class, loading spec]``; some models exist
only so). The engine reads either as the same component table, so a modular
folder is checked, sized and judged by the code that checks a classic one. The
modular index's loading specs name where each component comes from (a hub repo, an
absolute path of the machine that saved it): they are read back from disk, so they
decide nothing here: a component is loaded from the folder it lies in or not at all
(:mod:`engine.runtime.modular`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import stored

#: Index files in the order they are looked for: a folder with both is a classic pipeline.
CLASSIC_INDEX = "model_index.json"
MODULAR_INDEX = "modular_model_index.json"
INDEX_FILES = (CLASSIC_INDEX, MODULAR_INDEX)


@dataclass(frozen=True)
class PipelineIndex:
    """What a folder's index says: its pipeline class, its components (name -> [library,
    class], the classic shape), its other entries, and the file it was read from."""

    class_name: str
    components: dict[str, list[str]]
    entries: dict[str, object]
    #: The index file's name (``model_index.json`` or ``modular_model_index.json``).
    file: str = CLASSIC_INDEX

    @property
    def modular(self) -> bool:
        """Whether it is a modular pipeline's index."""
        return self.file == MODULAR_INDEX


def index_file(folder: Path) -> Path | None:
    """The folder's index file, or None where it has neither."""
    return next((folder / name for name in INDEX_FILES if (folder / name).is_file()), None)


def is_pipeline_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a diffusers pipeline (either index)."""
    return folder.is_dir() and index_file(folder) is not None


def parse_index(entries: dict[str, object], file: str) -> PipelineIndex:
    """The index ``entries`` (one JSON object, read from the index named ``file``) as a
    :class:`PipelineIndex`: components are the entries naming a library and a class (a modular
    one's loading spec dropped), a null entry (an optional component left out) is not one."""
    components = {}
    for name, value in entries.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) not in (2, 3):
            continue
        library, class_name = value[0], value[1]
        if isinstance(library, str) and library and isinstance(class_name, str) and class_name:
            components[name] = [library, class_name]
    return PipelineIndex(str(entries.get("_class_name", "")), components, entries, file)


def read_index(folder: Path) -> PipelineIndex | None:
    """The folder's index, classic or modular, read and parsed; None where it has neither or it
    is not one JSON object. An unreadable file raises as :func:`engine.stored.read_json` does."""
    path = index_file(folder)
    if path is None:
        return None
    entries = stored.read_json(path)
    if not isinstance(entries, dict):
        return None
    return parse_index(entries, path.name)


def modular_index(folder: Path) -> PipelineIndex | None:
    """The folder's index where it is a modular pipeline's (no classic index beside it), else None."""
    index = read_index(folder)
    return index if index is not None and index.modular else None
