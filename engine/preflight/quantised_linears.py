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
from dataclasses import dataclass
from pathlib import Path

from engine.errors import PreflightError

#: (dtype, shape) of each tensor in a file, by name.
Tensors = dict[str, tuple[str, tuple[int, ...]]]

#: Inputs each block scale covers.
NVFP4_BLOCK, MXFP8_BLOCK = 16, 32


@dataclass(frozen=True)
class LinearFormat:
    """How one format stores a Linear: its codes' dtypes, the suffixes of its scale tensors
    (required, then optional) and each scale's accepted shapes given the weight's (N, K)."""

    codes: tuple[str, ...]
    scales: tuple[str, ...]
    optional: tuple[str, ...] = ()
    packed: int = 1  # values a stored element holds


FORMATS: dict[str, LinearFormat] = {
    "fp8_e4m3fn": LinearFormat(("F8_E4M3", "F8_E5M2"), ()),  # a plain cast: each scale 1
    "fp8_scaled": LinearFormat(("F8_E4M3", "F8_E5M2"), ("scale_weight",), ("scale_input",)),
    "float8_e4m3fn": LinearFormat(("F8_E4M3",), ("weight_scale",), ("input_scale",)),
    "int8_tensorwise": LinearFormat(("I8",), ("weight_scale",), ("input_scale",)),
    "nvfp4": LinearFormat(("U8",), ("weight_scale", "weight_scale_2"), ("input_scale",), packed=2),
    "mxfp8": LinearFormat(("F8_E4M3",), ("weight_scale",), ("input_scale",)),
    "bfl_fp8r": LinearFormat(("F8_E4M3",), ("weight_scale",), ("input_scale",)),
    "bfl_nvfp4": LinearFormat(("U8",), ("weight_scale", "weight_scale_2", "input_scale"), packed=2),
}


def tiled_scale_count(rows: int, blocks: int) -> int:
    """Elements of a block-scale matrix ``rows x blocks`` laid in the tensor cores' 128 x 4 tiles."""
    return -(-rows // 128) * 128 * -(-blocks // 4) * 4


def _scale_shapes(fmt: str, rows: int, cols: int) -> dict[str, tuple[tuple[str, ...], object]]:
    """Each scale's accepted dtypes and shapes (a set of shapes, or an element count) for a weight
    stored as ``rows x cols`` elements."""
    one: set[tuple[int, ...]] = {(), (1,)}
    values = cols * FORMATS[fmt].packed
    table: dict[str, dict[str, tuple[tuple[str, ...], object]]] = {
        "fp8_e4m3fn": {},
        "fp8_scaled": {"scale_weight": (("F32", "BF16", "F16"), one | {(rows,), (rows, 1)}),
                       "scale_input": (("F32", "BF16", "F16"), one)},
        "float8_e4m3fn": {"weight_scale": (("F32",), one), "input_scale": (("F32",), one)},
        "int8_tensorwise": {"weight_scale": (("F32", "BF16", "F16"), one | {(rows,), (rows, 1)}),
                            "input_scale": (("F32",), one)},
        "nvfp4": {"weight_scale": (("F8_E4M3",), tiled_scale_count(rows, values // NVFP4_BLOCK)),
                  "weight_scale_2": (("F32",), one), "input_scale": (("F32",), one)},
        "mxfp8": {"weight_scale": (("U8", "F8_E8M0"), tiled_scale_count(rows, values // MXFP8_BLOCK)),
                  "input_scale": (("F32",), one)},
        "bfl_fp8r": {"weight_scale": (("F32",), {(rows,)}), "input_scale": (("F32",), one)},
        "bfl_nvfp4": {"weight_scale": (("F8_E4M3",), {(rows, values // NVFP4_BLOCK)}),
                      "weight_scale_2": (("F32",), one), "input_scale": (("F32",), one)},
    }
    return table[fmt]


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
    block = {"nvfp4": NVFP4_BLOCK, "bfl_nvfp4": NVFP4_BLOCK, "mxfp8": MXFP8_BLOCK}.get(fmt, 1)
    if values % block:
        raise _corrupt(file, f"{weight} holds {values} inputs a row, not whole blocks of {block}")
    for suffix, (dtypes, shapes) in _scale_shapes(fmt, rows, cols).items():
        name = f"{layer}.{suffix}"
        if name not in tensors:
            if suffix in spec.scales:
                raise _corrupt(file, f"{weight} is stored {fmt} but {name} is missing: its values would load unscaled")
            continue
        scale_dtype, scale_shape = tensors[name]
        fits = math.prod(scale_shape) == shapes if isinstance(shapes, int) else scale_shape in shapes  # type: ignore[operator]
        if scale_dtype not in dtypes or not fits:
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
    spec = FORMATS[fmt]
    return tuple(f"{layer}.{suffix}" for suffix in (*spec.scales, *spec.optional))


def _corrupt(file: Path, what: str) -> PreflightError:
    return PreflightError(f"{file}: {what}; download the file again", code="corrupt_checkpoint")
