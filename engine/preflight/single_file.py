"""A single checkpoint file: the family's denoiser, a GGUF transformer, or a whole pipeline.

A ``.safetensors`` file holds the denoiser (the other components come from a
base pipeline folder or hub repo), or, where the family's table says its files
can, every part of the pipeline (``single_file_pipeline``: no base weights,
only configs). A ``.gguf`` file is a transformer loaded through diffusers'
GGUF support on a base. The family is told from the file's tensor names (the
table's markers), else from its name; sizes come from the header alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import PreflightError
from engine.contract.plugins import Registry
from engine.policy.quant_filter import dense_gb
from engine.preflight.folder import pipeline_source
from engine.preflight.headers import (
    Shapes,
    check_same_model,
    gguf_shapes,
    complete_safetensors_file,
    sizes_by_scheme,
    whole_pipeline_sizes,
)
from engine.preflight.upstream_files import UpstreamFormat, upstream_format
from engine.preflight.source import ModelNotFound, ModelSource, NotAPipeline, unknown_family
from engine.requests.references import is_hub_id
from engine.contract.types import Checkpoint, ComponentSizes, FamilySpec


def single_file_source(
    registry: Registry, file: Path, forced: FamilySpec | None, base: str | Path | None
) -> ModelSource:
    """``file`` (``.safetensors`` or ``.gguf``) as a ``single_file``, ``gguf`` or
    ``single_file_pipeline`` source, with its base checked as a pipeline
    folder (sizes measured) or a hub repo id."""
    suffix = file.suffix.lower()
    if suffix not in (".safetensors", ".gguf"):
        raise NotAPipeline(
            f"{file} is neither .safetensors nor .gguf; point at a pipeline folder or a "
            "single-file checkpoint"
        )
    shapes, upstream = _read_file(file, suffix)
    keys = tuple(name for name, _ in shapes)
    spec = forced or family_from_keys(registry, keys) or registry.family_for_model_id(file.name)
    if spec is None:
        raise unknown_family(registry, str(file))
    checkpoint = spec.checkpoint(file.name) or spec.checkpoint(file.parent.name)
    if suffix == ".gguf" and spec.single_file.gguf_refused_reason:
        raise PreflightError(f"{file}: {spec.single_file.gguf_refused_reason}", code="gguf_unsupported")
    whole = None if suffix == ".gguf" else whole_pipeline_sizes(spec, shapes)
    if whole is not None:
        return whole_file_source(file, spec, checkpoint, base, whole, shapes)
    base_id = str(base) if base else (checkpoint or spec.default_checkpoint).repo
    others = registry.component_sizes(spec, checkpoint)
    if base and Path(base_id).expanduser().is_dir():
        if not (Path(base_id).expanduser() / "model_index.json").is_file():
            raise NotAPipeline(
                f"base {base_id} has no model_index.json; the base of a single-file or GGUF "
                "model is a diffusers pipeline folder (or a hub repo id)"
            )
        base_source = pipeline_source(registry, Path(base_id).expanduser(), spec)
        base_id = base_source.location
        check_same_model(file, shapes, base_id, list(base_source.denoiser_shapes))
        others = base_source.measured_sizes or others
        checkpoint = checkpoint or base_source.checkpoint
    elif base:
        if os.path.lexists(Path(base_id).expanduser()) or not is_hub_id(base_id):
            raise ModelNotFound(f"base {base_id} is not a pipeline folder (and not a hub repo id like org/name)")
        checkpoint = checkpoint or spec.checkpoint(base_id)
    if suffix == ".gguf":
        return ModelSource(
            "gguf", str(file), spec, checkpoint, base=base_id, gguf_gb=file.stat().st_size / 1e9,
            measured_sizes=others if base else None,
        )
    return ModelSource(
        "single_file", str(file), spec, checkpoint, base=base_id,
        measured_sizes=ComponentSizes(dense_gb(shapes), others.text_encoders_gb, others.vae_gb),
        scheme_gb=sizes_by_scheme(shapes, spec.quantisation.int8_dense_modules),
        denoiser_shapes=tuple(shapes), upstream_format=upstream.name if upstream else None,
    )


def _read_file(file: Path, suffix: str) -> tuple[Shapes, UpstreamFormat | None]:
    """The file's tensor shapes (the one header read; a format's own tensors left out, each
    weight as the model holds it) and the format its publisher stored it in, checked scale by
    scale (:mod:`engine.preflight.upstream_files`), if any."""
    if suffix == ".gguf":
        return gguf_shapes(file), None
    header, start, metadata = complete_safetensors_file(file)
    upstream = upstream_format(file, header, start, metadata)
    shapes = [(name, tuple(int(d) for d in info.get("shape", []))) for name, info in header.items()]  # type: ignore[attr-defined]
    if upstream is None:
        return shapes, None
    return [(name, upstream.shapes.get(name, shape)) for name, shape in shapes if name not in upstream.own], upstream


def whole_file_source(
    file: Path, spec: FamilySpec, checkpoint: Checkpoint | None, base: str | Path | None,
    sizes: ComponentSizes, shapes: Shapes,
) -> ModelSource:
    """A whole-pipeline file: every weight from the file, no base model. The
    component configs come from ``base`` when given (a folder or repo id; its
    weights are not read), else a diffusers config folder beside the file,
    else the checkpoint's hub repo (configs only; from the local cache offline)."""
    if base:
        config = str(Path(str(base)).expanduser()) if Path(str(base)).expanduser().is_dir() else str(base)
    elif (file.parent / "model_index.json").is_file():
        config = str(file.parent)
    else:
        config = (checkpoint or spec.default_checkpoint).repo
    prefix = next(p for p, part in spec.single_file.parts if part == "denoiser")
    denoiser = [(name[len(prefix):], shape) for name, shape in shapes if name.startswith(prefix)]
    return ModelSource(
        "single_file_pipeline", str(file), spec, checkpoint, base=config,
        measured_sizes=sizes, scheme_gb=sizes_by_scheme(denoiser, spec.quantisation.int8_dense_modules),
    )


def family_from_keys(registry: Registry, keys: tuple[str, ...]) -> FamilySpec | None:
    """The family most of whose single-file markers appear in ``keys`` (the first on a tie;
    None: no marker appears). A successor that keeps its predecessor's block names is told
    apart by the markers only it holds."""
    best, most = None, 0
    for spec in registry.families.values():
        hits = sum(1 for marker in spec.single_file.markers if any(marker in key for key in keys))
        if hits > most:
            best, most = spec, hits
    return best
