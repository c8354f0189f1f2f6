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
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.errors import EngineError, PreflightError
from engine.plugins import Registry
from engine.policy.inference import ModelFacts
from engine.policy.quant_filter import LAYOUTS, dense_gb, quantised_gb

Shapes = list[tuple[str, tuple[int, ...]]]
from engine.types import Checkpoint, ComponentSizes, FamilySpec

#: ``single_file_pipeline``: one ``.safetensors`` holding the whole pipeline
#: (its ``base`` is only where the component configs come from).
ModelKind = Literal["pipeline", "single_file", "single_file_pipeline", "gguf", "hub"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUTHY = {"1", "ON", "YES", "TRUE"}
#: Bytes per element of safetensors dtypes, to count parameters.
_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}


class ModelNotFound(EngineError, FileNotFoundError):
    """A local path that does not exist, or a file a local pipeline lacks."""

    code = "model_not_found"


class NotAPipeline(EngineError):
    """A local folder that is neither a diffusers pipeline nor a single file."""

    code = "not_a_pipeline"


@dataclass(frozen=True)
class ModelSource:
    kind: ModelKind
    location: str
    family: FamilySpec
    checkpoint: Checkpoint | None
    #: The pipeline that provides configs and the other components
    #: (single-file and GGUF models); None for full pipelines and hub ids.
    base: str | None = None
    measured_sizes: ComponentSizes | None = None
    #: The denoiser's GB under each scheme, sized from its tensor shapes.
    scheme_gb: Mapping[str, float] | None = None
    gguf_gb: float | None = None
    prequantised_scheme: str | None = None
    #: (name, shape) of every denoiser tensor, from its safetensors headers
    #: (local pipelines and single files); empty where unread.
    denoiser_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def facts(self, registry: Registry) -> ModelFacts:
        return ModelFacts(
            family=self.family,
            checkpoint=self.checkpoint,
            table_sizes=registry.component_sizes(self.family, self.checkpoint),
            measured_sizes=self.measured_sizes,
            measured_scheme_gb=self.scheme_gb,
            gguf_transformer_gb=self.gguf_gb,
            prequantised_scheme=self.prequantised_scheme,
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "location": self.location,
            "family": self.family.name,
            "checkpoint": self.checkpoint.name if self.checkpoint else None,
            "base": self.base,
        }


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
        return _single_file_source(registry, path, forced, base)
    if path.is_dir():
        if (path / "model_index.json").is_file():
            return _pipeline_source(registry, path, forced)
        singles = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf"))
        if len(singles) == 1:
            return _single_file_source(registry, singles[0], forced, base)
        found = f"{len(singles)} .safetensors/.gguf files" if singles else "no weights file"
        raise NotAPipeline(
            f"{path} is not a diffusers pipeline: it has no model_index.json, and {found} "
            "(a single-file checkpoint folder holds exactly one). Point at a pipeline folder "
            "(saved with save_pretrained) or at the checkpoint file itself."
        )
    if os.path.lexists(path):
        raise ModelNotFound(f"{path} is a broken symlink or neither a file nor a folder; point at the model itself")
    if not is_hub_id(text):
        raise ModelNotFound(f"{path} does not exist (and is not a hub repo id like org/name)")
    if not allow_hub:
        raise ModelNotFound(
            f"{text} is not a local model, and hub repo ids are not accepted here; "
            "download the model and pass its local folder",
            code="hub_not_allowed",
        )
    spec = forced or registry.family_for_model_id(text)
    if spec is None:
        raise _unknown_family(registry, text)
    return ModelSource(
        "hub", text, spec, spec.checkpoint(text),
        prequantised_scheme="nf4" if spec.is_prequantised(text) else None,
    )


def looks_like_path(text: str) -> bool:
    """Whether ``text`` is written as a filesystem path, not a hub repo id.

    A repo id is exactly ``org/name``. Anything anchored (``/``, ``./``,
    ``../``, ``~``), with a backslash, with no slash or more than one, or with a
    ``.``/``..`` component is a path; a path that does not exist is missing,
    and is never sent to a hub.
    """
    if text.startswith(("/", "~")) or "\\" in text or os.sep in text.replace("/", ""):
        return True
    parts = text.split("/")
    return len(parts) != 2 or any(part in ("", ".", "..") for part in parts)


def is_hub_id(text: str) -> bool:
    """``text`` is written as a hub repo id (``org/name``), not as a path.

    Syntax only: the caller checks first that no such local path exists.
    """
    return not looks_like_path(text) and ".." not in text and bool(_HUB_ID.match(text))


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (read now, not at import time)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUTHY


def hub_access_error(source: ModelSource) -> PreflightError | None:
    """Why the hub repo ``source`` needs cannot be had now, or None.

    A hub model, or the hub base of a single-file / GGUF model, is refused
    before anything is evicted when the hub is offline and the repo is not in
    the local cache, instead of failing inside the loader after the GPU was
    freed. Reads the cache only; never reaches the network.
    """
    if source.kind == "hub":
        repo: str | None = source.location
    elif source.base and not Path(source.base).expanduser().is_dir():
        repo = source.base
    else:
        repo = None
    if repo is None or not hub_offline() or _in_hub_cache(repo):
        return None
    return PreflightError(
        f"{repo} is a hub repo id, the hub is offline here (HF_HUB_OFFLINE is set) and the "
        f"repo is not in the local cache; download it (huggingface-cli download {repo}) and "
        "pass the local folder, or allow hub access",
        code="hub_offline",
    )


def _in_hub_cache(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo, "model_index.json"), str)


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
        f"{source.location}'s {source.family.denoiser}; name modules it has (a module name or "
        f"its last parts, e.g. {', '.join(source.family.lora_targets[:2]) or 'to_q'})",
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


def _pipeline_source(registry: Registry, folder: Path, forced: FamilySpec | None) -> ModelSource:
    index = _read_json(folder / "model_index.json")
    class_name = str(index.get("_class_name", ""))
    own = registry.family_for_pipeline_class(class_name)
    if forced is not None and own is not None and own.name != forced.name:
        raise PreflightError(
            f"{folder} is a {own.label} pipeline ({class_name} in its model_index.json), not "
            f"{forced.label}; drop the family or pass family={own.name}",
            code="family_mismatch",
        )
    spec = forced or own
    if spec is None:
        known = sorted(c for f in registry.families.values() for c in f.pipeline_class_names)
        raise NotAPipeline(
            f"{folder}/model_index.json names pipeline class {class_name!r}, which no installed "
            f"family plugin handles (known: {', '.join(known)}); pass --family or install its plugin",
            code="family_unknown",
        )
    components = {
        name: value for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and value and value[0]
    }
    missing = [name for name in components if not (folder / name).is_dir()]
    if missing:
        raise ModelNotFound(
            f"{folder} is missing {', '.join(missing)} (listed in its model_index.json); "
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
    denoiser_config = folder / spec.denoiser / "config.json"
    if spec.denoiser in components and not denoiser_config.is_file():
        raise ModelNotFound(
            f"{folder / spec.denoiser} has no config.json; the pipeline folder is incomplete",
            code="model_file_missing",
        )
    quantised = spec.is_prequantised(folder.name) or "quantization_config" in (
        _read_json(denoiser_config) if denoiser_config.is_file() else {}
    )
    sizes, denoiser_shapes = _measured_sizes(folder, spec, components)
    return ModelSource(
        "pipeline",
        str(folder),
        spec,
        spec.checkpoint(folder.name),
        measured_sizes=sizes,
        scheme_gb=sizes_by_scheme(denoiser_shapes) if denoiser_shapes and not quantised else None,
        prequantised_scheme="nf4" if quantised else None,
        denoiser_shapes=tuple(denoiser_shapes),
    )


def _single_file_source(
    registry: Registry, file: Path, forced: FamilySpec | None, base: str | Path | None
) -> ModelSource:
    suffix = file.suffix.lower()
    if suffix not in (".safetensors", ".gguf"):
        raise NotAPipeline(
            f"{file} is neither .safetensors nor .gguf; point at a pipeline folder or a "
            "single-file checkpoint"
        )
    shapes = [] if suffix == ".gguf" else tensor_shapes([file])  # the one header read
    keys = _gguf_tensor_names(file) if suffix == ".gguf" else tuple(name for name, _ in shapes)
    spec = forced or _family_from_keys(registry, keys) or registry.family_for_model_id(file.name)
    if spec is None:
        raise _unknown_family(registry, str(file))
    checkpoint = spec.checkpoint(file.name) or spec.checkpoint(file.parent.name)
    if suffix == ".gguf" and spec.gguf_refused_reason:
        raise PreflightError(f"{file}: {spec.gguf_refused_reason}", code="gguf_unsupported")
    whole = _whole_pipeline_sizes(spec, shapes)
    if whole is not None:
        return _whole_file_source(file, spec, checkpoint, base, whole, shapes)
    base_id = str(base) if base else (checkpoint or spec.default_checkpoint).repo
    others = registry.component_sizes(spec, checkpoint)
    if base and Path(base_id).expanduser().is_dir():
        if not (Path(base_id).expanduser() / "model_index.json").is_file():
            raise NotAPipeline(
                f"base {base_id} has no model_index.json; the base of a single-file or GGUF "
                "model is a diffusers pipeline folder (or a hub repo id)"
            )
        base_source = _pipeline_source(registry, Path(base_id).expanduser(), spec)
        base_id = base_source.location
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
        scheme_gb=sizes_by_scheme(shapes),
        denoiser_shapes=tuple(shapes),
    )


def _whole_pipeline_sizes(spec: FamilySpec, shapes: Shapes) -> ComponentSizes | None:
    """bf16 GB per part of a file holding the family's whole pipeline, or None
    when the family's files are denoiser-only or this one lacks a part."""
    if not spec.single_file_whole_pipeline or not spec.single_file_parts:
        return None
    groups: dict[str, Shapes] = {"denoiser": [], "text_encoders": [], "vae": []}
    for name, shape in shapes:
        part = next((p for prefix, p in spec.single_file_parts if name.startswith(prefix)), None)
        if part is not None:
            groups[part].append((name, shape))
    if not all(groups.values()):
        return None
    return ComponentSizes(dense_gb(groups["denoiser"]), dense_gb(groups["text_encoders"]), dense_gb(groups["vae"]))


def _whole_file_source(
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
    prefix = next(p for p, part in spec.single_file_parts if part == "denoiser")
    denoiser = [(name[len(prefix):], shape) for name, shape in shapes if name.startswith(prefix)]
    return ModelSource(
        "single_file_pipeline", str(file), spec, checkpoint, base=config,
        measured_sizes=sizes, scheme_gb=sizes_by_scheme(denoiser),
    )


def _family_from_keys(registry: Registry, keys: tuple[str, ...]) -> FamilySpec | None:
    for spec in registry.families.values():
        if any(marker in key for marker in spec.single_file_markers for key in keys):
            return spec
    return None


def _unknown_family(registry: Registry, what: str) -> EngineError:
    return EngineError(
        f"could not tell the model family of {what}; pass --family "
        f"({', '.join(registry.families)})",
        code="family_unknown",
    )


def _measured_sizes(
    folder: Path, spec: FamilySpec, components: dict[str, list[str]]
) -> tuple[ComponentSizes | None, Shapes]:
    """bf16 GB per part from the safetensors headers (None if a part has none),
    and the denoiser's tensor shapes, so its headers are read once."""
    totals = {"denoiser": 0.0, "text": 0.0, "vae": 0.0}
    denoiser: Shapes = []
    complete = True
    for name in components:
        files = sorted((folder / name).glob("*.safetensors"))
        shapes = tensor_shapes(files)  # every component: a truncated file fails here
        if not (name in (spec.denoiser, "vae") or name.startswith("text_encoder")):
            continue
        if not files:
            complete = False
            continue
        if name == spec.denoiser:
            denoiser = shapes
        part = "denoiser" if name == spec.denoiser else "vae" if name == "vae" else "text"
        totals[part] += dense_gb(shapes)
    sizes = ComponentSizes(totals["denoiser"], totals["text"], totals["vae"]) if complete else None
    return sizes, denoiser


def sizes_by_scheme(shapes: Shapes) -> dict[str, float]:
    """A denoiser's GB under each scheme, from tensor names and shapes alone."""
    return {scheme: quantised_gb(shapes, scheme) for scheme in LAYOUTS}


def tensor_shapes(files: list[Path]) -> Shapes:
    """(name, shape) of every tensor in ``files``, from their headers (no weights read)."""
    return [
        (name, tuple(int(d) for d in info.get("shape", [])))  # type: ignore[union-attr]
        for file in files
        for name, info in _safetensors_header(file).items()
    ]


def _safetensors_header(file: Path) -> dict[str, dict[str, object]]:
    """The header of a complete safetensors file (its tensor data fills the file exactly)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                raise ValueError("header too large")
            if 8 + length > size:
                raise ValueError(f"its {length}-byte header runs past the end of the {size}-byte file")
            header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        header.pop("__metadata__", None)
        end, data = _data_end(header), size - 8 - length
        if end != data:
            raise ValueError(
                f"truncated or padded: its header describes {end:,} bytes of tensor data, "
                f"the file holds {data:,}"
            )
    except (OSError, ValueError, struct.error) as exc:
        raise NotAPipeline(
            f"{file} is not a complete safetensors file ({exc}); re-download or re-export it",
            code="corrupt_checkpoint",
        ) from None
    return header


def _data_end(header: dict[str, object]) -> int:
    """Where the last tensor's bytes end; ValueError for an entry that cannot be read."""
    end = 0
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and o >= 0 for o in offsets) and offsets[0] <= offsets[1]
            and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise ValueError(f"tensor {name!r} has no valid shape and data_offsets")
        width = _DTYPE_BYTES.get(str(info.get("dtype")))  # type: ignore[union-attr]
        if width is not None and math.prod(shape) * width != offsets[1] - offsets[0]:
            raise ValueError(f"tensor {name!r} ({shape}) does not fill its {offsets[1] - offsets[0]} bytes")
        end = max(end, offsets[1])
    return end


def _gguf_tensor_names(file: Path) -> tuple[str, ...]:
    from gguf import GGUFReader  # numpy only; no torch

    try:
        return tuple(t.name for t in GGUFReader(str(file)).tensors)
    except (OSError, ValueError) as exc:
        raise NotAPipeline(f"{file} is not a readable GGUF file ({exc})", code="corrupt_checkpoint") from None


def _read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NotAPipeline(f"{path} is not valid JSON ({exc})", code="corrupt_checkpoint") from None
    if not isinstance(data, dict):
        raise NotAPipeline(f"{path} is not a JSON object", code="corrupt_checkpoint")
    return data
