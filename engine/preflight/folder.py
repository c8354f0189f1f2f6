"""A local diffusers pipeline folder, checked and sized before anything loads.

The family comes from ``model_index.json``'s ``_class_name`` (a forced family
must agree with it); every component it lists must be there with weights, and
every safetensors file is sized and checked for completeness from its header
(:mod:`engine.preflight.headers`), so an incomplete copy is refused here,
naming the folder and what is missing.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

from engine import stored
from engine.errors import PreflightError
from engine.contract.plugins import Registry
from engine.policy.encoders import precast_encoders
from engine.policy.plan import ModelDefaults
from engine.preflight.folder_checkpoint import checkpoint_by_files, folder_layout
from engine.preflight.pipeline_index import index_file, parse_index
from engine.preflight.library_quant import library_scheme
from engine.preflight.headers import Shapes, measured_sizes, sizes_by_scheme, tensor_storage
from engine.preflight.quantised_folder import StoredMarker, judge_stored
from engine.preflight.borrowed import borrowed_gb, lacking
from engine.preflight.stored_layouts import layout_of_names
from engine.preflight.source import ModelNotFound, ModelSource, NotAPipeline
from engine.contract.types import BorrowedComponent, ComponentSizes, FamilySpec


def pipeline_source(registry: Registry, folder: Path, forced: FamilySpec | None) -> ModelSource:
    """``folder`` (which has a ``model_index.json`` or a ``modular_model_index.json``) as a
    ``pipeline`` source; refuses a family that disagrees, or a missing or weightless component."""
    path = index_file(folder)
    assert path is not None, "called on a pipeline folder"
    index = parse_index(read_json(path), path.name)
    class_name = index.class_name
    own = registry.family_for_pipeline_class(class_name)
    if forced is not None and own is not None and own.name != forced.name:
        raise PreflightError(
            f"{folder} is a {own.label} pipeline ({class_name} in its {path.name}), not "
            f"{forced.label}; drop the family or pass family={own.name}",
            code="family_mismatch",
        )
    spec = forced or own
    if spec is None:
        known = sorted(c for f in registry.families.values() for c in f.pipeline_class_names)
        raise NotAPipeline(
            f"{path} names pipeline class {class_name!r}, which no installed "
            f"family plugin handles (known: {', '.join(known)}); give family=NAME or install its plugin",
            code="family_unknown",
        )
    # What the engine's workflows never call (a partition of a workflow it does not serve) may be left out of a download.
    borrowed = lacking(spec, folder)  # taken from the family's named repos (their access checked with the hub's)
    components = {name: value for name, value in index.components.items()
                  if name not in spec.pipeline.unused_components and name not in {b.component for b in borrowed}}
    _check_complete(folder, spec, components, path.name)
    denoiser_config = folder / spec.pipeline.denoiser / "config.json"
    marker = stored_marker(folder, spec, index.entries)  # written by `diffusion-engine quantize`, judged here
    by_library = library_scheme(denoiser_config, read_json(denoiser_config)) if denoiser_config.is_file() else None
    quantised = marker is not None or by_library is not None or spec.is_prequantised(folder.name)
    sizes, shapes_of = _measured(folder, spec, components, marker, borrowed)
    denoiser_shapes = shapes_of.get(spec.pipeline.denoiser, [])
    every_denoiser = [shape for shapes in shapes_of.values() for shape in shapes]
    return ModelSource(
        "pipeline",
        str(folder),
        spec,
        checkpoint_by_files(spec, spec.checkpoint_of_folder(folder.name, class_name), class_name,
                            folder_layout(folder, spec, components, index.entries), folder.name),
        measured_sizes=sizes,
        scheme_gb=(sizes_by_scheme(every_denoiser, spec.quantisation.int8_dense_modules)
                   if denoiser_shapes and not quantised else None),
        prequantised_scheme=marker.scheme if marker is not None else by_library or ("nf4" if quantised else None),
        denoiser_shapes=tuple(denoiser_shapes),
        precast_encoders=precast_encoders({
            name: tensor_storage(sorted((folder / name).glob("*.safetensors")))
            for name in components if name.startswith("text_encoder")
        }),
        defaults=own_defaults(folder),
        borrowed=borrowed,
        stored_layout=layout_of_names(spec, (name for shapes in shapes_of.values() for name, _ in shapes)),
    )


def _measured(folder: Path, spec: FamilySpec, components: dict[str, list[str]], marker: StoredMarker | None,
              borrowed: tuple[BorrowedComponent, ...]) -> tuple[ComponentSizes | None, dict[str, Shapes]]:
    """The folder's sizes from its headers (and each denoiser's shapes): a stored denoiser sized
    as its scheme's dense model, the components it lacks and borrows counted with its encoders."""
    sizes, shapes_of = measured_sizes(folder, spec, components)
    if marker is not None and marker.dense_gb is not None and sizes is not None:
        sizes = dataclasses.replace(sizes, transformer_gb=marker.dense_gb)
    if borrowed and sizes is not None:
        sizes = dataclasses.replace(sizes, text_encoders_gb=sizes.text_encoders_gb + borrowed_gb(borrowed))
    return sizes, shapes_of


def _check_complete(folder: Path, spec: FamilySpec, components: dict[str, list[str]], index_name: str) -> None:
    """Refuse a folder missing a component its index lists, one with no weights, or a denoiser
    without its config: an incomplete copy, named with what is missing."""
    missing = [name for name in components if not (folder / name).is_dir()]
    if missing:
        raise ModelNotFound(
            f"{folder} is missing {', '.join(missing)} (listed in its {index_name}); "
            "the pipeline folder is incomplete: copy or download it again",
            code="model_file_missing",
        )
    weightless = [
        name for name in components
        if (folder / name / "config.json").is_file()
        and not any(next((folder / name).glob(p), None) for p in ("*.safetensors", "*.bin"))
    ]
    if weightless:
        raise ModelNotFound(
            f"{folder} has no weights in {', '.join(weightless)} (a config.json but no "
            ".safetensors or .bin file); the pipeline folder is incomplete",
            code="model_file_missing",
        )
    denoiser_config = folder / spec.pipeline.denoiser / "config.json"
    if spec.pipeline.denoiser in components and not denoiser_config.is_file():
        raise ModelNotFound(
            f"{folder / spec.pipeline.denoiser} has no config.json; the pipeline folder is incomplete",
            code="model_file_missing",
        )


def stored_marker(folder: Path, spec: FamilySpec, index: dict[str, object]) -> StoredMarker | None:
    """The denoiser's marker where ``quantize`` stored it (each expert's too, judged the same:
    :func:`engine.preflight.quantised_folder.judge_stored`); None for a dense folder."""
    probe = spec.training.probe if spec.training is not None else None
    family_class = probe.model_class if probe is not None else None
    markers = [judge_stored(folder / name, index.get(name), family_class)
               for name in (spec.pipeline.denoiser, *spec.pipeline.experts) if (folder / name).is_dir()]
    return next((marker for marker in markers if marker is not None), None)


#: A pipeline folder's own defaults, beside its ``model_index.json`` (diffusers ignores it).
DEFAULTS_FILE = "diffusion_engine.json"


def own_defaults(folder: Path) -> ModelDefaults:
    """The folder's own ``{"defaults": {"width", "height", "steps", "frames"}}`` (a tiny pipeline's
    64 px, 4 steps and a short clip), so a request that names no size, such as OpenAI's ``size="auto"``, gets
    the model's own; a missing file is the table's defaults, a malformed one refused."""
    path = folder / DEFAULTS_FILE
    if not path.is_file():
        return ModelDefaults()
    given = read_json(path).get("defaults", {})
    fields = ("width", "height", "steps", "frames")
    if not isinstance(given, dict) or any(
        not isinstance(given.get(k, 1), int) or isinstance(given.get(k), bool) or given.get(k, 1) < 1 for k in fields
    ):
        raise NotAPipeline(f"{path}: defaults must map width, height, steps and frames to positive whole numbers",
                           code="corrupt_checkpoint")
    return ModelDefaults(**{k: given[k] for k in fields if k in given})


def read_json(path: Path) -> dict[str, object]:
    """A JSON object from a pipeline's config file; refuses anything else."""
    try:
        data = stored.read_json(path)
    except (OSError, ValueError) as exc:
        raise NotAPipeline(f"{path} is not valid JSON ({exc})", code="corrupt_checkpoint") from None
    if not isinstance(data, dict):
        raise NotAPipeline(f"{path} is not a JSON object", code="corrupt_checkpoint")
    return data
