"""Single files stored quantised by their publishers, told and checked from their headers.

What people download for ComfyUI and from the model makers is often quantised already: the
older ComfyUI ``fp8_scaled`` (a ``scale_weight`` beside each float8 weight and an empty
``scaled_fp8`` tensor naming it), plain fp8 casts, ComfyUI's mixed-precision files (a marker
per layer, :mod:`engine.preflight.quant_markers`: float8, ConvRot int8, nvfp4, mxfp8), and
Black Forest Labs' FP8R and NVFP4 linears. Read as a dense file, any of them would load its
codes as weights, or without their scales. This module names the format from the header (and
the markers' few bytes), checks every quantised layer's codes and scales
(:mod:`engine.preflight.quantised_linears`), and gives the shape of each weight the codes
encode, so the file is sized and matched against its base as the model it holds. A layout it
does not read (Nunchaku's SVDQuant, int8 or packed codes with no marker saying how) is refused
naming a tensor, before anything is evicted. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import PreflightError
from engine.preflight.quant_markers import SUFFIX as MARKER_SUFFIX
from engine.preflight.quant_markers import LayerMarker, layer_markers
from engine.preflight.quantised_linears import FORMATS, Tensors, checked_linear, own_tensors

#: safetensors dtypes of float8 codes, and of integer or packed codes.
FLOAT8 = ("F8_E4M3", "F8_E5M2")
PACKED = ("I8", "U8", "I4", "U4", "F4")
#: The empty tensor the older ComfyUI fp8 files carry to name their format.
_FP8_SCALED_MARKER = "scaled_fp8"
#: Tensors only Nunchaku's SVDQuant layers carry (the low-rank branch, the smoothing).
_SVDQUANT = (".proj_down", ".proj_up", ".smooth_factor", ".wscales")
#: The names any format gives a Linear's scales.
_SCALE_NAMES = frozenset(suffix for spec in FORMATS.values() for suffix in spec.suffixes)


@dataclass(frozen=True)
class UpstreamFormat:
    """How a single file is stored: each quantised layer's format, the shape of each weight
    whose codes are stored in another (packed or padded), and the format's own tensors."""

    layers: Mapping[str, LayerMarker]
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    own: frozenset[str] = frozenset()

    @property
    def formats(self) -> tuple[str, ...]:
        """The formats its layers are stored in (ConvRot int8 named apart from plain int8)."""
        return tuple(sorted({scheme_of(marker) for marker in self.layers.values()}))

    @property
    def name(self) -> str:
        formats = self.formats
        return formats[0] if len(formats) == 1 else f"mixed ({', '.join(formats)})"


def scheme_of(marker: LayerMarker) -> str:
    """A layer's format as the plan names it: ``int8_convrot`` for rotated int8."""
    return "int8_convrot" if marker.format == "int8_tensorwise" and marker.convrot_group else marker.format


def upstream_format(file: Path, header: dict[str, dict[str, object]], data_start: int,
                    metadata: dict[str, str]) -> UpstreamFormat | None:
    """The format ``file`` is stored in (its header entries, where its data starts, its
    ``__metadata__``); None: dense. Refuses (``corrupt_checkpoint``) a scale missing or
    mismatched, naming it, and (``unsupported_format``) codes of a layout it does not read."""
    tensors: Tensors = {name: (str(info.get("dtype")), tuple(int(d) for d in info.get("shape", [])))  # type: ignore[attr-defined]
                        for name, info in header.items()}
    layers = _layers(file, tensors, layer_markers(file, header, data_start, metadata))
    if layers is None:
        return None
    shapes, own = {}, {name for name in tensors if name.endswith(MARKER_SUFFIX) or name == _FP8_SCALED_MARKER}
    for layer, marker in layers.items():
        shape = checked_linear(file, layer, marker.format, tensors, marker.orig_shape)
        own.update(own_tensors(layer, marker.format))
        if shape != tensors[f"{layer}.weight"][1]:
            shapes[f"{layer}.weight"] = shape
    _refuse_leftovers(file, tensors, layers, own)
    return UpstreamFormat(layers, shapes, frozenset(own))


def _layers(file: Path, tensors: Tensors, markers: dict[str, LayerMarker]) -> dict[str, LayerMarker] | None:
    """Each quantised layer and its format, by the file's own signs (markers, then the older
    ComfyUI names, then BFL's), or None where nothing in it is quantised."""
    if markers:
        return markers
    svdquant = next((name for name in tensors if name.endswith(_SVDQUANT)), None)
    if svdquant is not None:
        raise PreflightError(
            f"{file} is a Nunchaku SVDQuant file ({svdquant}): its W4A4 layers run only on Nunchaku's CUDA "
            "kernels, which diffusers loads from a diffusers folder whose transformer config names "
            "quant_method nunchaku_lite (int4 on Turing to Ada and Blackwell, nvfp4 on Blackwell; not Hopper); "
            "load that folder on such a GPU, or the dense file",
            code="unsupported_format",
        )
    weights = [name.removesuffix(".weight") for name, (dtype, _) in tensors.items()
               if name.endswith(".weight") and dtype in (*FLOAT8, *PACKED)]
    if _FP8_SCALED_MARKER in tensors or any(name.endswith(".scale_weight") for name in tensors):
        return {layer: LayerMarker("fp8_scaled") for layer in weights}
    if any(name.endswith(".weight_scale") for name in tensors):
        return {name.removesuffix(".weight_scale"): LayerMarker(
            "bfl_nvfp4" if name.replace(".weight_scale", ".weight_scale_2") in tensors else "bfl_fp8r")
            for name in tensors if name.endswith(".weight_scale")}
    packed = next((f"{layer}.weight" for layer in weights if tensors[f"{layer}.weight"][0] in PACKED), None)
    if packed is not None:
        raise unsupported(file, packed, tensors[packed][0])
    return {layer: LayerMarker("fp8_e4m3fn") for layer in weights} or None


def _refuse_leftovers(file: Path, tensors: Tensors, layers: Mapping[str, LayerMarker], own: set[str]) -> None:
    """Refuse a scale that scales no quantised layer, and codes no layer's format reads."""
    weights = {f"{layer}.weight" for layer in layers}
    for name, (dtype, _) in tensors.items():
        if name in own or name in weights:
            continue
        if name.rsplit(".", 1)[-1] in _SCALE_NAMES:
            raise PreflightError(f"{file}: {name} scales no quantised weight; download the file again",
                                 code="corrupt_checkpoint")
        if dtype in (*FLOAT8, *PACKED):
            raise unsupported(file, name, dtype)


def unsupported(file: Path, name: str, dtype: str) -> PreflightError:
    return PreflightError(
        f"{file} holds quantised codes ({name} is {dtype}) with no scale or marker saying how they are stored: "
        "a layout this engine does not read (it reads ComfyUI's fp8_scaled and marked float8, ConvRot int8, "
        "nvfp4 and mxfp8 files, and BFL's FP8R and NVFP4); load the dense (bf16) file, or a GGUF of the model",
        code="unsupported_format",
    )
