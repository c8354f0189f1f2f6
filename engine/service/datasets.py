"""``engine.datasets``: the datasets a run trains on.

Every face (the web page's dataset manager, ``/v1/datasets``, a Python app)
lists, uploads, captions and deletes through :class:`Datasets`, over
:class:`engine.service.dataset_library.DatasetLibrary`; the engine adds what only it
knows: which dataset a training run is using, here or in another process
sharing the runs folder, so that one is not changed under it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.deprecation import deprecate, register
from engine.service.dataset_library import DatasetLibrary

Roots = Sequence[Path | str] | None

_CALLED = register("Engine.datasets()", "Engine.datasets.list()")


class Datasets:
    """The dataset folders of one engine. ``roots`` (on each method): the dataset
    roots to work in (a server passes its ``--datasets``); default the engine's own
    (``Engine(dataset_roots=...)``, else the per-user datasets folder)."""

    def __init__(self, roots: tuple[Path, ...], runs_dir: Path, current_run: Callable[[], Any]) -> None:
        """``current_run``: the run this engine started, or None (its dataset is in use)."""
        self.roots = roots
        self._runs_dir = runs_dir
        self._current_run = current_run

    def __call__(self, *, roots: Roots = None) -> list[dict[str, object]]:
        """``engine.datasets()``, the spelling before the namespace: :meth:`list`, with a warning."""
        deprecate(_CALLED)
        return self.list(roots=roots)

    def list(self, *, roots: Roots = None) -> list[dict[str, object]]:
        """Each dataset folder under the roots: name, path, images, clips, captioned, ``in_use_by``."""
        return self._library(roots).datasets()

    def counts(self, folder: Path | str) -> dict[str, int]:
        """The images and clips a run on ``folder`` would find (by name: nothing is decoded)."""
        from engine.service.dataset_library import media_counts

        return media_counts(Path(folder))

    def get(self, name: str, *, roots: Roots = None) -> dict[str, object]:
        """One dataset's images, each with the caption a run would train with and its source."""
        return self._library(roots).dataset(name)

    def thumbnail(self, name: str, image: str, size: int = 256, *, roots: Roots = None) -> bytes:
        """A PNG thumbnail of one dataset image, at most ``size`` px a side."""
        return self._library(roots).thumbnail(name, image, size)

    def add_images(self, name: str, files: Sequence[tuple[str, bytes]], *, roots: Roots = None) -> dict[str, object]:
        """Upload images (file name, bytes) into dataset ``name`` (created if new); all or none."""
        return self._library(roots).add_images(name, files)

    def set_caption(self, name: str, image: str, caption: str, *, roots: Roots = None) -> dict[str, object]:
        """Write (or, with ``""``, clear) one image's caption where the trainer reads it."""
        return self._library(roots).set_caption(name, image, caption)

    def remove_image(self, name: str, image: str, *, roots: Roots = None) -> dict[str, object]:
        """Delete one image with its caption files and ``metadata.jsonl`` line."""
        return self._library(roots).remove_image(name, image)

    def in_use(self, folder: Path | str) -> str | None:
        """The id of a run training on ``folder`` (this engine's, or one in the runs folder
        whose process is alive), or None."""
        from engine.training.records import list_runs

        real = os.path.realpath(folder)
        run = self._current_run()
        if run is not None and not run.record.finished and _same(run.record.config.get("dataset_dir"), real):
            return str(run.record.run_id)
        for record in list_runs(self._runs_dir):
            if not record.finished and _same(record.config.get("dataset_dir"), real):
                return str(record.run_id)
        return None

    def _library(self, roots: Roots) -> DatasetLibrary:
        return DatasetLibrary(tuple(roots) if roots is not None else self.roots, self.in_use)


def _same(recorded: object, real: str) -> bool:
    return isinstance(recorded, str) and os.path.realpath(recorded) == real
