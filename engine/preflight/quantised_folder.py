"""A pipeline folder whose denoiser ``diffusion-engine quantize`` stored quantised, judged torch-free.

The denoiser folder holds :data:`MARKER` beside diffusers' ``config.json``: the
scheme, the device it was quantised for, the folder it was made from, its dense
size (so the plan sizes it as the scheme it is) and its model class. The weights
are torchao tensors flattened into :data:`WEIGHTS` (:mod:`engine.runtime.prequantised`).

A stored folder is a folder someone may have copied, edited or planted, and
loading it runs torchao's and diffusers' readers after the resident model is
gone. So :func:`judge_stored` reads it first, from headers alone, as the loader
will: the marker as a typed record (:mod:`engine.stored`); the component's class
in ``model_index.json``, in its ``config.json`` (no ``auto_map``: no remote code)
and in the marker, agreeing with each other and with the family's; and every
tensor the weights' metadata names: its torchao class and the objects inside it
on the engine's allow-list, the scheme's quantised class with its data tensors
present in their dtypes and shapes, every plain tensor a float one, no tensor
the metadata does not name, and as many quantised layers as the marker says. A
folder that fails is a :class:`CorruptQuantisedModel` naming the file and the
field, before anything is evicted.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from engine import stored
from engine.contract.schemes import STORED_SCHEMES as STORED_SCHEMES  # re-exported
from engine.errors import PreflightError
from engine.preflight.headers import read_safetensors_file

#: The denoiser folder's note of what it holds (the engine's, beside diffusers' config.json).
MARKER = "diffusion_engine_quantized.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
#: Each scheme's torchao tensor class and the safetensors dtype of its quantised data.
QUANTISED_CLASS: dict[str, tuple[str, str]] = {"int8": ("Int8Tensor", "I8"), "int8_convrot": ("Int8Tensor", "I8"),
                                                "fp8": ("Float8Tensor", "F8_E4M3")}
#: The objects a stored tensor's metadata may hold (torchao's own reader allows these and more:
#: the engine accepts only what its two schemes write).
ALLOWED_OBJECTS = frozenset({"Int8Tensor", "Float8Tensor", "Float8MMConfig", "QuantizeTensorToFloat8Kwargs",
                             "QuantizeTensorToInt8Kwargs", "PerRow", "PerTensor", "KernelPreference",
                             "MappingType", "torch.dtype"})
#: ``torch.dtype`` names a stored tensor's metadata may name.
DTYPE_NAMES = frozenset({"float32", "bfloat16", "float16", "int8", "uint8", "int32", "float8_e4m3fn",
                         "float8_e5m2"})
#: The safetensors dtypes a plain (kept-dense) tensor may have.
PLAIN_DTYPES = frozenset({"F32", "BF16", "F16"})
#: A diffusers model class name (never ``AutoModel``, which resolves another class at load).
_MODEL_CLASS = r"^[A-Z][A-Za-z0-9]{0,79}Model$"


class CorruptQuantisedModel(PreflightError):
    """A stored pre-quantised folder that does not hold what its marker says."""

    code = "corrupt_quantised_model"


@dataclass(frozen=True)
class StoredMarker:
    """:data:`MARKER` as read back (every field checked; the model class since this release)."""

    scheme: Literal["int8", "int8_convrot", "fp8"]
    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "bfloat16", "float16"]
    made_from: Annotated[str, Field(max_length=4096)]
    torchao: Annotated[str, Field(max_length=40)]
    layers: Annotated[int, Field(ge=1, le=1_000_000)]
    dense_gb: Annotated[float, Field(gt=0, le=100_000)] | None
    model_class: Annotated[str, Field(pattern=_MODEL_CLASS)] | None = None


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a pre-quantised denoiser folder (None: not one, or not readable as one)."""
    try:
        return asdict(stored.read_record(Path(folder) / MARKER, StoredMarker, root=folder))
    except stored.UnreadableRecord:
        return None


def judge_stored(component: Path, index_entry: object, family_class: str | None) -> StoredMarker | None:
    """The marker of the stored component folder ``component`` once everything the loader will
    read agrees with it (see the module doc); None where it holds no marker (not stored).
    ``index_entry``: its ``model_index.json`` entry; ``family_class``: the denoiser class the
    family names, where it names one."""
    marker_path = component / MARKER
    if not marker_path.exists() and not marker_path.is_symlink():
        return None
    try:
        marker = stored.read_record(marker_path, StoredMarker, root=component)
    except stored.UnreadableRecord as exc:
        raise _refused(marker_path, exc.field or "", exc.problem) from None
    _judge_class(component, index_entry, family_class, marker)
    _judge_tensors(component / WEIGHTS, marker)
    return marker


def _judge_class(component: Path, index_entry: object, family_class: str | None, marker: StoredMarker) -> None:
    index = component.parent / "model_index.json"
    if not (isinstance(index_entry, list) and len(index_entry) == 2 and index_entry[0] == "diffusers"
            and isinstance(index_entry[1], str) and re.fullmatch(_MODEL_CLASS, index_entry[1])
            and index_entry[1] != "AutoModel"):
        raise _refused(index, component.name, f"names {index_entry!r}, not a diffusers model class")
    name = index_entry[1]
    config_path = component / "config.json"
    try:
        config = stored.read_json(config_path, root=component)
    except stored.UnreadableRecord as exc:
        raise _refused(config_path, "", exc.problem) from None
    if not isinstance(config, dict):
        raise _refused(config_path, "", "it is not a JSON object")
    if "auto_map" in config:
        raise _refused(config_path, "auto_map", "it asks for code from outside diffusers; the engine runs none")
    for where, field, said in ((config_path, "_class_name", config.get("_class_name")),
                               (component / MARKER, "model_class", marker.model_class or name),
                               (index, "(the family's denoiser class)", family_class or name)):
        if said != name:
            raise _refused(where, field, f"says {str(said)[:80]!r} where model_index.json says {name!r}")


def _judge_tensors(weights: Path, marker: StoredMarker) -> None:
    if stored.confined_file(weights.parent, weights.name) is None:
        raise _refused(weights, "", "it is missing, or not a file inside the folder")
    try:
        header, _, metadata = read_safetensors_file(weights)
    except ValueError as exc:
        raise _refused(weights, "", f"it is not a complete safetensors file ({exc})") from None
    quantised_class = QUANTISED_CLASS[marker.scheme][0]
    names = _metadata(weights, metadata, "tensor_names")
    if not (isinstance(names, list) and all(isinstance(n, str) and "." in n for n in names)):
        raise _refused(weights, "__metadata__.tensor_names", "it is not a list of tensor names (dense weights "
                       "under the marker, or metadata removed)")
    claimed: set[str] = set()
    layers = 0
    for name in names:
        tensors, quantised = _judge_tensor(weights, header, name, _metadata(weights, metadata, name), marker)
        claimed |= tensors
        layers += quantised
    leftover = sorted(set(header) - claimed)
    if leftover:
        raise _refused(weights, leftover[0], "a tensor the metadata does not name")
    if layers != marker.layers:
        raise _refused(weights, "__metadata__", f"it holds {layers} {quantised_class} layers where the marker "
                       f"says {marker.layers}")


def _judge_tensor(weights: Path, header: dict[str, dict[str, object]], name: str, entry: object,
                  marker: StoredMarker) -> tuple[set[str], bool]:
    """The header tensors one metadata entry claims, once they are what it says, and whether
    it is a quantised layer."""
    quantised_class, data_dtype = QUANTISED_CLASS[marker.scheme]
    field = f"__metadata__.{name}"
    kind = entry.get("_type") if isinstance(entry, dict) else None
    if kind == "Tensor":
        if name not in header or header[name].get("dtype") not in PLAIN_DTYPES:
            raise _refused(weights, field, "a plain tensor that is missing or not a float tensor")
        return {name}, False
    if kind != quantised_class or not isinstance(entry, dict):
        raise _refused(weights, f"{field}._type", f"{str(kind)[:80]!r} is not a tensor class the engine loads "
                       f"for {marker.scheme} ({quantised_class} or a plain Tensor)")
    _objects(weights, field, entry.get("_data"))
    parts = entry.get("_tensor_data_names")
    if not (isinstance(parts, list) and "qdata" in parts and all(isinstance(p, str) for p in parts)):
        raise _refused(weights, f"{field}._tensor_data_names", "it does not list the quantised data")
    module, _, weight = name.rpartition(".")
    flat = {part: f"{module}._{weight}_{part}" for part in parts}
    missing = [key for key in flat.values() if key not in header]
    if missing:
        raise _refused(weights, field, f"its data tensor {missing[0]!r} is not in the file")
    qdata = header[flat["qdata"]]
    shape = qdata.get("shape")
    if qdata.get("dtype") != data_dtype or not (isinstance(shape, list) and len(shape) == 2):
        raise _refused(weights, field, f"its qdata is {qdata.get('dtype')} {shape}, not a 2-D {data_dtype} "
                       f"matrix as {marker.scheme} stores")
    rows = [(part, header[key].get("shape")) for part, key in flat.items() if part != "qdata"]
    wrong = [(part, other[0]) for part, other in rows if isinstance(other, list) and other and other[0] != shape[0]]
    if wrong:
        raise _refused(weights, field, f"its {wrong[0][0]} has {wrong[0][1]} rows where qdata has {shape[0]}")
    return set(flat.values()), True


def _metadata(weights: Path, metadata: dict[str, str], key: str) -> Any:
    if key not in metadata:
        raise _refused(weights, f"__metadata__.{key}", "it is missing (metadata removed)")
    try:
        return stored.parse_json(metadata[key], weights)
    except stored.UnreadableRecord as exc:
        raise _refused(weights, f"__metadata__.{key}", exc.problem) from None


def _objects(weights: Path, field: str, value: object) -> None:
    """Every ``{"_type": ...}`` object inside a tensor's metadata is on the allow-list, and every
    ``torch.dtype`` names a dtype."""
    if isinstance(value, list):
        for item in value:
            _objects(weights, field, item)
    elif isinstance(value, dict):
        kind = value.get("_type")
        if kind is not None:
            if kind not in ALLOWED_OBJECTS:
                raise _refused(weights, f"{field}._type", f"{str(kind)[:80]!r} is not an object the engine loads")
            if kind == "torch.dtype" and value.get("_data") not in DTYPE_NAMES:
                raise _refused(weights, f"{field}.dtype", f"{str(value.get('_data'))[:40]!r} is not a dtype")
        for item in value.values():
            _objects(weights, field, item)


def _refused(path: Path, field: str, problem: str) -> CorruptQuantisedModel:
    where = f"{path}" + (f", {field}" if field else "")
    return CorruptQuantisedModel(f"the stored pre-quantised model is not what its marker says: {where}: {problem}; "
                                 "write it again with `diffusion-engine quantize`, or load the dense model")


__all__ = ["MARKER", "STORED_SCHEMES", "WEIGHTS", "CorruptQuantisedModel", "StoredMarker", "judge_stored",
           "read_marker"]
