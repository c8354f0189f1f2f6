"""What the web page picks from: the models, datasets and LoRAs under the
configured roots, and the files a training run wrote.

The API takes paths confined to the roots (:mod:`engine.server.paths`);
these routes list what lies there, so a person picks instead of typing a
path. Listings are shallow and bounded (a root holding a million files
answers with the first :data:`MAX_ENTRIES`), and read nothing but names and
a few small headers (``model_index.json``). A run's files are served only
from inside that run's own folder, looked up by its id in the runs folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse

from engine.errors import EngineError
from engine.places import within
from engine import Engine
from engine.requests import RUN_ADAPTER_FILES
from engine.server.settings import ServerSettings

#: The most entries one listing returns (per root, per kind).
MAX_ENTRIES = 500
#: Single-file checkpoints and LoRAs.
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".ckpt")


class RunFileNotFound(EngineError):
    """No such run, or no such file in it (a 404: see ``docs/errors.md``)."""


def browse_router(engine: Engine, settings: ServerSettings) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.get("/roots")
    def roots() -> dict[str, Any]:
        """Models (pipeline folders, single files), datasets (folders of images and clips) and LoRAs under the roots."""
        return {
            "models": [entry for root in settings.model_roots for entry in listed_models(engine, Path(root))],
            "datasets": [entry for root in settings.dataset_roots for entry in _datasets(engine, Path(root))],
            "loras": [entry for root in settings.lora_roots for entry in _loras(Path(root))],
        }

    @api.get("/images/plans")
    def plans() -> dict[str, Any]:
        """Every family's plan here, or why it cannot run here, in one answer (the machine page)."""
        return engine.images.plans()

    @api.get("/training/runs/{run_id}")
    def run(run_id: str) -> dict[str, Any]:
        """One run's record and the files in its folder."""
        return engine.training.run(run_id, by_path=False)

    @api.delete("/training/runs/{run_id}")
    def remove_run(run_id: str) -> dict[str, Any]:
        """Delete a finished run's folder (``run_in_progress`` while it trains)."""
        return engine.training.remove(run_id, by_path=False)

    @api.get("/training/runs/{run_id}/files")
    def run_files(run_id: str) -> list[dict[str, Any]]:
        """Every file the run wrote (its LoRA, checkpoints, samples, charts), relative to its folder."""
        folder = _run_folder(engine, run_id)
        found = []
        for name in engine.training.files(run_id, by_path=False)[:MAX_ENTRIES]:  # bounded before it walks; names only
            try:
                found.append({"path": name, "bytes": (folder / name).lstat().st_size})
            except OSError:
                continue  # removed since it was listed
        return found

    @api.get("/training/runs/{run_id}/files/{name:path}")
    def run_file(run_id: str, name: str) -> FileResponse:
        """One file of the run, confined to the run's folder (no ``..``, no symlink out)."""
        folder = _run_folder(engine, run_id)
        path = Path(os.path.realpath(folder / name))
        if folder not in path.parents or not path.is_file():
            raise RunFileNotFound(f"run {run_id} has no file {name[:120]!r}; list them at /v1/training/runs/{run_id}/files",
                                  code="unknown_run_file")
        return FileResponse(path, filename=path.name)

    return api


def _run_folder(engine: Engine, run_id: str) -> Path:
    """The folder of the run ``run_id`` in the engine's runs folder (a plain id, never a path)."""
    try:
        return Path(os.path.realpath(str(engine.training.run(run_id, by_path=False)["folder"])))
    except EngineError:
        raise RunFileNotFound(f"no run {run_id[:120]!r} in the runs folder; list them at /v1/training/runs",
                              code="unknown_run") from None


def _children(root: Path) -> list[Path]:
    """The visible entries of ``root`` that stay inside it: a symlink that leads out is
    neither listed nor its real path shown (the API would refuse it anyway)."""
    try:
        entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    except OSError:
        return []  # a root that is gone or unreadable lists nothing; using it names the problem
    inside = []
    for path in entries:
        if within(root, path):
            inside.append(path)
        if len(inside) == MAX_ENTRIES:
            break
    return inside


def listed_models(engine: Engine, root: Path) -> list[dict[str, Any]]:
    """The pipeline folders and single files in ``root``: name, real path, kind, family, when made."""
    found = []
    for path in _children(root):
        if engine.catalog.is_pipeline_folder(path):
            kind = "pipeline"
        elif path.is_file() and path.suffix.lower() in WEIGHT_SUFFIXES:
            kind = "single_file"
        else:
            continue
        found.append({"name": path.name, "path": os.path.realpath(path), "kind": kind,
                      "created": int(path.lstat().st_mtime), **_family(engine, path)})
    return found


def _family(engine: Engine, path: Path) -> dict[str, str | None]:
    """The family the engine would load ``path`` as (headers only), or why it cannot tell."""
    try:
        return {"family": engine.catalog.check_model(str(path))["family"], "problem": None}
    except EngineError as error:
        return {"family": None, "problem": f"{error.code}: {error.message}"}


def _datasets(engine: Engine, root: Path) -> list[dict[str, Any]]:
    found = []
    for path in _children(root):
        if path.is_dir():
            found.append({"name": path.name, "path": os.path.realpath(path), **engine.datasets.counts(path)})
    return found


def _loras(root: Path) -> list[dict[str, Any]]:
    """Loose LoRA files, and the adapters of the training runs kept under ``root`` (a run's
    final LoRA and its EMA, named after the run), so a run trained here is one click away."""
    found = []
    for path in _children(root):
        if path.is_file() and path.suffix.lower() in WEIGHT_SUFFIXES:
            found.append({"name": path.name, "path": os.path.realpath(path)})
        elif path.is_dir():
            for adapter in RUN_ADAPTER_FILES:
                if (path / adapter).is_file() and not (path / adapter).is_symlink():
                    ema = "ema" in adapter
                    found.append({"name": f"{path.name} (EMA)" if ema else path.name,
                                  "path": os.path.realpath(path / adapter), "run": path.name})
    return found
