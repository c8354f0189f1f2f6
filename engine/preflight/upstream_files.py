"""Single files stored quantised by their publishers, told and checked from their headers.

ComfyUI's ``fp8_scaled`` files hold each Linear's weight in float8 with a ``scale_weight``
beside it (the weight is ``fp8 x scale``; sometimes a ``scale_input`` for fp8 activations) and
an empty ``scaled_fp8`` tensor naming the format; plain fp8 casts hold float8 weights with no
scale (a scale of 1). Read as a dense file, either would load its float8 codes as weights, or
with their scales missing. This module names the format from the header alone, checks every
scale against its weight (a weight with its scale missing, or a scale of another shape, refuses
the file naming the tensor), and refuses a file holding quantised tensors of a layout the engine
does not read yet (int8 or packed 4-bit codes: ConvRot, nvfp4, mxfp8, SVDQuant), before anything
is evicted. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import PreflightError
from engine.policy.stored_formats import KEPT_AS

#: safetensors dtypes of float8 codes, and of integer or packed codes.
FLOAT8 = ("F8_E4M3", "F8_E5M2")
PACKED = ("I8", "U8", "I4", "U4", "F4")
#: The tensors ComfyUI writes beside the weights (the format's marker, the activation scales).
_MARKERS = ("scaled_fp8",)
_SCALE, _INPUT_SCALE = ".scale_weight", ".scale_input"


@dataclass(frozen=True)
class UpstreamFormat:
    """How a single file is stored: its format's name and the engine scheme it is kept as."""

    name: str
    kept_as: str


def upstream_format(file: Path, storage: list[tuple[str, str, tuple[int, ...]]]) -> UpstreamFormat | None:
    """The format ``file`` is stored in, from its tensors' (name, dtype, shape); None: dense.
    Refuses (``corrupt_checkpoint``) a scale missing or mismatched, and (``unsupported_format``)
    quantised codes of a layout the engine does not read."""
    dtypes = {name: dtype for name, dtype, _ in storage}
    shapes = {name: shape for name, _, shape in storage}
    packed = [name for name, dtype, _ in storage if dtype in PACKED and name not in _MARKERS]
    if packed:
        raise PreflightError(
            f"{file} holds quantised codes ({packed[0]} is {dtypes[packed[0]]}, {len(packed)} such tensors): a "
            "pre-quantised layout this engine does not read yet (int8 ConvRot, nvfp4, mxfp8 or SVDQuant files); "
            "load the dense (bf16) file, or a GGUF of the model",
            code="unsupported_format",
        )
    float8 = [name for name, dtype, _ in storage if dtype in FLOAT8 and name not in _MARKERS]
    if not float8:
        return None
    scales = {name.removesuffix(_SCALE) for name in dtypes if name.endswith(_SCALE)}
    if not scales and not any(name in dtypes for name in _MARKERS):
        return UpstreamFormat("fp8_e4m3fn", KEPT_AS["fp8_e4m3fn"])  # a plain cast: each scale is 1
    for name in float8:
        module = name.removesuffix(".weight")
        if module not in scales:
            raise PreflightError(
                f"{file} is stored fp8_scaled but {name} has no {module}{_SCALE}: its values would load "
                "unscaled; download the file again",
                code="corrupt_checkpoint",
            )
        scale = shapes[module + _SCALE]
        rows = shapes[name][0] if shapes[name] else 1
        if tuple(scale) not in ((), (1,), (rows,), (rows, 1)):
            raise PreflightError(
                f"{file}: {module}{_SCALE} has shape {list(scale)}, which scales neither all of {name} "
                f"({list(shapes[name])}) nor each of its rows; download the file again",
                code="corrupt_checkpoint",
            )
    orphans = sorted(module + _SCALE for module in scales if module + ".weight" not in float8)
    if orphans:
        raise PreflightError(f"{file}: {orphans[0]} scales no float8 weight; download the file again",
                             code="corrupt_checkpoint")
    return UpstreamFormat("fp8_scaled", KEPT_AS["fp8_scaled"])


def is_format_tensor(name: str) -> bool:
    """A tensor of the format itself (a scale, the marker), not of the model."""
    return name.endswith((_SCALE, _INPUT_SCALE)) or name in _MARKERS
