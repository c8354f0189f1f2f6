"""What a model argument points at, decided cheaply before anything loads.

A model is one of:

- ``pipeline``: a local folder with ``model_index.json`` (family from its
  ``_class_name``); every component it lists must be there;
- ``single_file``: a ``.safetensors`` file, or a folder holding exactly one
  and no ``model_index.json``: the family's denoiser in one file, the other
  components from a base pipeline;
- ``gguf``: a ``.gguf`` transformer (or a folder with exactly one), loaded
  through diffusers' GGUF support on top of a base pipeline;
- ``hub``: a repo id (``org/name``) that is not a local path.

A local folder that is none of these is refused here, naming the folder and
what is missing, before anything is evicted or loaded. A string written as a
path (``./x``, ``/data/x``, ``a/b/c``) that does not exist is a missing path,
never a hub id; a hub id is accepted only where the caller allows the hub,
and refused up front when the hub is offline and the repo is not cached. A
forced family must agree with the pipeline's own ``model_index.json``, and
every safetensors file must be complete (its header's data offsets cover the
file exactly), so a truncated download fails here and not in the loader. Sizes of local
checkpoints are read from the safetensors headers (a few KB per file, no
weights, no torch), so fine-tunes and unknown checkpoints are planned from
what they are.

This module decides which kind a model argument is; the kinds are resolved in
:mod:`engine.preflight.folder` (pipeline folders) and
:mod:`engine.preflight.single_file` (single, GGUF and whole-pipeline files),
sized from their headers by :mod:`engine.preflight.headers`, with hub ids told
from paths in :mod:`engine.preflight.hub`, into a
:class:`~engine.preflight.source.ModelSource`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from engine.errors import EngineError, PreflightError
from engine.contract.plugins import Registry
from engine.contract.types import Checkpoint
from engine.preflight.folder import pipeline_source
from engine.preflight.pipeline_index import is_pipeline_folder
from engine.preflight.hub import hub_access_error, hub_offline
from engine.preflight.single_file import single_file_source
from engine.preflight.borrowed import lacking
from engine.preflight.source import ModelKind, ModelNotFound, ModelSource, NotAPipeline, unknown_family
from engine.requests.references import is_hub_id, looks_like_path

#: Imported from here by the service, the CLI and the tests.
__all__ = [
    "ModelKind",
    "ModelNotFound",
    "ModelSource",
    "NotAPipeline",
    "checkpoint_named",
    "hub_access_error",
    "hub_offline",
    "is_hub_id",
    "lora_target_error",
    "looks_like_path",
    "resolve_model",
]


def resolve_model(
    registry: Registry,
    model: str | Path,
    *,
    family: str | None = None,
    base: str | Path | None = None,
    allow_hub: bool = True,
) -> ModelSource:
    """Classify ``model`` and find its family; refuse what cannot load.

    ``allow_hub=False`` refuses repo ids (a server confined to local roots).
    """
    text = str(model)
    if not text.strip() or "\x00" in text:
        raise EngineError(
            "the model is empty (or holds a NUL byte); give a local pipeline folder, a "
            "checkpoint file, or a hub repo id (org/name)",
            code="invalid_request",
        )
    path = Path(text).expanduser()
    forced = registry.family(family) if family else None
    if path.is_file():
        return single_file_source(registry, path, forced, base)
    if path.is_dir():
        if is_pipeline_folder(path):
            return pipeline_source(registry, path, forced)
        singles = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf"))
        if len(singles) == 1:
            return single_file_source(registry, singles[0], forced, base)
        found = f"{len(singles)} .safetensors/.gguf files" if singles else "no weights file"
        raise NotAPipeline(
            f"{path} is not a diffusers pipeline: it has no model_index.json, and {found} "
            "(a single-file checkpoint folder holds exactly one). Point at a pipeline folder "
            "(saved with save_pretrained) or at the checkpoint file itself."
        )
    if os.path.lexists(path):
        raise ModelNotFound(f"{path} is a broken symlink or neither a file nor a folder; point at the model itself")
    named = checkpoint_named(registry, text)
    if named is not None:
        text = named.repo  # a checkpoint name (as `families` lists it) stands for its hub repo (and folder)
    elif not is_hub_id(text):
        names = ", ".join(c.name for f in registry.families.values() for c in f.checkpoints)
        raise ModelNotFound(
            f"{path} does not exist, is not a hub repo id like org/name, and is not a checkpoint name "
            f"({names})"
        )
    if not allow_hub:
        raise ModelNotFound(
            f"{text} is not a local model, and hub repo ids are not accepted here; "
            "download the model and pass its local folder",
            code="hub_not_allowed",
        )
    spec = forced or registry.family_for_model_id(text)
    if spec is None:
        raise unknown_family(registry, text)
    return ModelSource(
        "hub", text, spec, named if named is not None and named in spec.checkpoints else spec.checkpoint(text),
        prequantised_scheme="nf4" if spec.is_prequantised(text) else None, borrowed=lacking(spec, None),
    )


def checkpoint_named(registry: Registry, text: str) -> Checkpoint | None:
    """The checkpoint of any installed family that ``text`` names (its name, label or hub
    reference ``org/repo/subfolder@revision``, any case)."""
    lowered = text.strip().lower()
    for family in registry.families.values():
        for checkpoint in family.checkpoints:
            if lowered in (checkpoint.name.lower(), checkpoint.label.lower(), checkpoint.reference.lower()):
                return checkpoint
    return None


def lora_target_error(source: ModelSource, targets: Iterable[str]) -> PreflightError | None:
    """The LoRA targets that name no layer of the denoiser, or None.

    Read from the safetensors headers (no weights): peft adapts a module whose
    name is the target or ends with ``.target``. A target that matches nothing
    would fail (or adapt nothing) only after the GPU was taken. Hub models
    have no local headers and are not checked here.
    """
    modules = _lora_modules(source.denoiser_shapes)
    if not modules:
        return None
    missing = [target for target in targets if target not in modules]
    if not missing:
        return None
    return PreflightError(
        f"LoRA target(s) {', '.join(repr(t) for t in missing)} name no layer with weights in "
        f"{source.location}'s {source.family.pipeline.denoiser}; name modules it has (a module name or "
        f"its last parts, e.g. {', '.join(source.family.lora.targets[:2]) or 'to_q'})",
        code="unknown_lora_target",
    )


def _lora_modules(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> frozenset[str]:
    """Module names with a 2+-dimensional weight, and every dotted suffix of them."""
    names: set[str] = set()
    for tensor, shape in shapes:
        module, _, leaf = tensor.rpartition(".")
        if leaf != "weight" or len(shape) < 2 or not module:
            continue
        parts = module.split(".")
        names.update(".".join(parts[i:]) for i in range(len(parts)))
    return frozenset(names)
