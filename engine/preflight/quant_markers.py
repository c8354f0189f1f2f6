"""ComfyUI's per-layer quantisation markers, read from a single file without loading it.

ComfyUI's mixed-precision files say how each quantised Linear is stored in one of two places:
a ``<layer>.comfy_quant`` tensor (a few dozen bytes of UTF-8 JSON in a ``U8`` or ``I8`` vector,
e.g. ``{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}``) or, for the
whole file, ``__metadata__["_quantization_metadata"]`` (``{"layers": {layer: marker}}``); a
layer found in the metadata takes it from there, as ComfyUI reads it. The markers are data, so
each is validated here: a marker that is not a JSON object naming a known ``format`` refuses
the file naming the layer, never guessed from. Torch-free: the marker bytes are read by seek.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import stored
from engine.errors import PreflightError

SUFFIX = ".comfy_quant"
_METADATA_KEY = "_quantization_metadata"
#: A marker is a short JSON object; anything longer is not one.
_MAX_MARKER_BYTES = 4096
#: The formats ComfyUI's loader reads (``comfy/quant_ops.py``) that this engine reads too.
FORMATS = ("float8_e4m3fn", "int8_tensorwise", "nvfp4", "mxfp8")
#: ConvRot's rotation is a regular Hadamard: Kronecker powers of a 4x4 seed.
_CONVROT_GROUPS = (16, 64, 256, 1024)


@dataclass(frozen=True)
class LayerMarker:
    """One layer's stored format: ``format`` (one of :data:`FORMATS`) and, for ConvRot int8,
    the Hadamard group its input channels were rotated in (0: not rotated)."""

    format: str
    convrot_group: int = 0
    orig_shape: tuple[int, ...] | None = None


def layer_markers(file: Path, header: dict[str, dict[str, object]], data_start: int,
                  metadata: dict[str, str]) -> dict[str, LayerMarker]:
    """Every marked layer of ``file`` (its header entries, where its data starts, its
    ``__metadata__``), each marker checked; {} for a file with none."""
    from_metadata: dict[str, Any] = {}
    if _METADATA_KEY in metadata:
        record = _parsed(file, metadata[_METADATA_KEY], f"__metadata__[{_METADATA_KEY!r}]")
        layers = record.get("layers") if isinstance(record, dict) else None
        if not isinstance(layers, dict):
            raise _bad(file, f"__metadata__[{_METADATA_KEY!r}]", "has no 'layers' object")
        from_metadata = layers
    markers = {layer: _marker(file, f"{layer} in {_METADATA_KEY}", value) for layer, value in from_metadata.items()}
    for name, info in header.items():
        layer = name.removesuffix(SUFFIX)
        if name.endswith(SUFFIX) and layer not in markers:
            markers[layer] = _marker(file, name, _parsed(file, _tensor_bytes(file, name, info, data_start), name))
    return markers


def _tensor_bytes(file: Path, name: str, info: dict[str, object], data_start: int) -> bytes:
    """The bytes of the small tensor ``name``, read by seek (the header's offsets were checked
    against the file by :func:`engine.preflight.headers.read_safetensors_file`)."""
    begin, end = (int(offset) for offset in info["data_offsets"])  # type: ignore[attr-defined]
    if str(info.get("dtype")) not in ("U8", "I8") or not 0 < end - begin <= _MAX_MARKER_BYTES:
        raise _bad(file, name, f"is {info.get('dtype')} of {end - begin} bytes, not a short JSON byte vector")
    with file.open("rb") as handle:
        handle.seek(data_start + begin)
        return handle.read(end - begin).rstrip(b"\0 ")


def _parsed(file: Path, data: bytes | str, where: str) -> Any:
    try:
        return stored.parse_json(data, file)
    except stored.UnreadableRecord as exc:
        raise _bad(file, where, exc.problem) from None


def _marker(file: Path, where: str, value: Any) -> LayerMarker:
    if not isinstance(value, dict) or value.get("format") not in FORMATS:
        named = value.get("format") if isinstance(value, dict) else None
        raise PreflightError(
            f"{file}: {where} marks a format this engine does not read ({named!r}; it reads "
            f"{', '.join(FORMATS)}); load the dense (bf16) file, or a GGUF of the model",
            code="unsupported_format",
        )
    group = 0
    if value["format"] == "int8_tensorwise" and value.get("convrot"):
        group = value.get("convrot_groupsize", 256)
        if group not in _CONVROT_GROUPS:
            raise _bad(file, where, f"has a ConvRot group of {group!r} (a regular Hadamard is 16, 64, 256 or 1024)")
    shape = value.get("orig_shape")
    if shape is not None and not (isinstance(shape, list) and all(isinstance(d, int) and d > 0 for d in shape)):
        raise _bad(file, where, f"has an orig_shape of {shape!r}")
    return LayerMarker(str(value["format"]), int(group), tuple(shape) if shape is not None else None)


def _bad(file: Path, where: str, what: str) -> PreflightError:
    return PreflightError(f"{file}: {where} {what}; download the file again", code="corrupt_checkpoint")
