"""How each publisher's format stores one Linear, checked from the header alone.

Each format keeps a Linear's ``weight`` as codes and puts its scales beside it, under the
layer's name. This module knows, per format, the dtype of the codes, the scale tensors that
must be there and the shape each must have, and the shape of the weight the codes encode
(packed fp4 holds two values a byte; ComfyUI pads fp4 and mxfp8 weights to 16 or 32 and says
the unpadded shape in the marker). A scale missing, of another dtype or of a shape that does
not fit its weight refuses the file naming that tensor (``corrupt_checkpoint``): loaded, its
codes would be read with the wrong scales, or as weights.

The layouts, from their publishers:

- ``fp8_scaled`` (ComfyUI, older): float8 ``weight``, ``scale_weight`` for the tensor or per row.
- ``float8_e4m3fn`` (ComfyUI markers): float8 ``weight``, fp32 ``weight_scale`` for the tensor.
- ``int8_tensorwise`` (ComfyUI markers; ConvRot when the marker says ``convrot``): int8
  ``weight``, fp32 ``weight_scale`` per row (``[N, 1]``) or for the tensor.
- ``nvfp4`` (ComfyUI markers): ``weight`` two E2M1 codes a byte (``[N, K/2]``), float8 block
  scales (one per 16 inputs) in the tiled layout the tensor cores read (128 x 4 tiles, padded),
  fp32 ``weight_scale_2`` for the tensor.
- ``mxfp8`` (ComfyUI markers): float8 ``weight``, E8M0 block scales (one per 32 inputs, ``U8``)
  in the same tiled layout.
- ``bfl_fp8r`` (Black Forest Labs, diffusers' ``bfl`` quantizer): float8 ``weight``, fp32
  ``weight_scale`` per row.
- ``bfl_nvfp4`` (BFL, the ModelOpt layout): packed ``weight``, float8 ``weight_scale``
  ``[N, K/16]`` (not tiled), fp32 ``weight_scale_2`` and ``input_scale`` scalars.

Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import PreflightError

#: (dtype, shape) of each tensor in a file, by name.
Tensors = dict[str, tuple[str, tuple[int, ...]]]

#: Inputs each block scale covers.
NVFP4_BLOCK, MXFP8_BLOCK = 16, 32


#: A scale's accepted shape given the weight's rows and the inputs it holds: a set of shapes,
#: or an element count (block scales laid in tiles, whose matrix shape a writer may flatten).
ShapeRule = Callable[[int, int], "set[tuple[int, ...]] | int"]


def _one(rows: int, values: int) -> set[tuple[int, ...]]:
    return {(), (1,)}


def _one_or_rows(rows: int, values: int) -> set[tuple[int, ...]]:
    return {(), (1,), (rows,), (rows, 1)}


def tiled_scale_count(rows: int, blocks: int) -> int:
    """Elements of a block-scale matrix ``rows x blocks`` laid in the tensor cores' 128 x 4 tiles."""
    return -(-rows // 128) * 128 * -(-blocks // 4) * 4


@dataclass(frozen=True)
class Scale:
    """One scale tensor beside a format's codes: its suffix, dtypes, shape rule, and whether the
    format needs it."""

    suffix: str
    dtypes: tuple[str, ...]
    shape: ShapeRule
    required: bool = True


@dataclass(frozen=True)
class LinearFormat:
    """How one format stores a Linear: its codes' dtypes, its scales, how many values a stored
    element holds and how many inputs a block scale covers."""

    codes: tuple[str, ...]
    scales: tuple[Scale, ...]
    packed: int = 1
    block: int = 1

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(scale.suffix for scale in self.scales)


_F32 = ("F32",)
_INPUT = Scale("input_scale", _F32, _one, required=False)
FORMATS: dict[str, LinearFormat] = {
    "fp8_e4m3fn": LinearFormat(("F8_E4M3", "F8_E5M2"), ()),  # a plain cast: each scale 1
    "fp8_scaled": LinearFormat(("F8_E4M3", "F8_E5M2"), (
        Scale("scale_weight", ("F32", "BF16", "F16"), _one_or_rows),
        Scale("scale_input", ("F32", "BF16", "F16"), _one, required=False))),
    "float8_e4m3fn": LinearFormat(("F8_E4M3",), (Scale("weight_scale", _F32, _one), _INPUT)),
    "int8_tensorwise": LinearFormat(("I8",), (Scale("weight_scale", ("F32", "BF16", "F16"), _one_or_rows), _INPUT)),
    "nvfp4": LinearFormat(("U8",), (
        Scale("weight_scale", ("F8_E4M3",), lambda rows, values: tiled_scale_count(rows, values // NVFP4_BLOCK)),
        Scale("weight_scale_2", _F32, _one), _INPUT), packed=2, block=NVFP4_BLOCK),
    "mxfp8": LinearFormat(("F8_E4M3",), (
        Scale("weight_scale", ("U8", "F8_E8M0"), lambda rows, values: tiled_scale_count(rows, values // MXFP8_BLOCK)),
        _INPUT), block=MXFP8_BLOCK),
    "bfl_fp8r": LinearFormat(("F8_E4M3",), (Scale("weight_scale", _F32, lambda rows, values: {(rows,)}), _INPUT)),
    "bfl_nvfp4": LinearFormat(("U8",), (
        Scale("weight_scale", ("F8_E4M3",), lambda rows, values: {(rows, values // NVFP4_BLOCK)}),
        Scale("weight_scale_2", _F32, _one), Scale("input_scale", _F32, _one)), packed=2, block=NVFP4_BLOCK),
}


def checked_linear(file: Path, layer: str, fmt: str, tensors: Tensors,
                   orig_shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The shape of the weight ``layer`` stores in ``fmt`` (as the model holds it), after checking
    its codes and every scale; raises naming the tensor that does not fit."""
    spec, weight = FORMATS[fmt], f"{layer}.weight"
    if weight not in tensors:
        raise _corrupt(file, f"{layer} is marked {fmt} but the file has no {weight}")
    dtype, shape = tensors[weight]
    if dtype not in spec.codes or len(shape) != 2:
        raise _corrupt(file, f"{weight} is {dtype} {list(shape)}, not the 2-D {'/'.join(spec.codes)} codes {fmt} stores")
    rows, cols = shape
    values = cols * spec.packed
    if values % spec.block:
        raise _corrupt(file, f"{weight} holds {values} inputs a row, not whole blocks of {spec.block}")
    for scale in spec.scales:
        name = f"{layer}.{scale.suffix}"
        if name not in tensors:
            if scale.required:
                raise _corrupt(file, f"{weight} is stored {fmt} but {name} is missing: its values would load unscaled")
            continue
        scale_dtype, scale_shape = tensors[name]
        accepted = scale.shape(rows, values)
        fits = math.prod(scale_shape) == accepted if isinstance(accepted, int) else scale_shape in accepted
        if scale_dtype not in scale.dtypes or not fits:
            raise _corrupt(file, f"{name} is {scale_dtype} {list(scale_shape)}, which does not scale {weight} "
                                 f"({list(shape)}) as {fmt} lays it out")
    logical = (rows, values)
    if orig_shape is not None:
        if len(orig_shape) != 2 or orig_shape[0] > rows or orig_shape[1] > values:
            raise _corrupt(file, f"{layer}'s marker says {list(orig_shape)}, larger than {weight} holds ({list(logical)})")
        return tuple(orig_shape)
    return logical


def own_tensors(layer: str, fmt: str) -> tuple[str, ...]:
    """The names of the format's own tensors for ``layer`` (its scales), not the model's."""
    return tuple(f"{layer}.{suffix}" for suffix in FORMATS[fmt].suffixes)


def _corrupt(file: Path, what: str) -> PreflightError:
    return PreflightError(f"{file}: {what}; download the file again", code="corrupt_checkpoint")
