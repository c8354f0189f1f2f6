"""A single file its publisher stored quantised, read into the dense model's weights.

Each quantised Linear is decoded as its format defines it (the preflight named the format and
checked every scale, :mod:`engine.preflight.upstream_files`): float8 codes times their scale
(``fp8_scaled``, marked ``float8_e4m3fn``, a plain cast), int8 codes times their per-row scale
and, for ConvRot, rotated back (:mod:`engine.runtime.convrot`), nvfp4's packed E2M1 codes
through diffusers' own decoder with their block scales taken out of the tensor cores' tiled
layout (torchao's ``from_blocked``), mxfp8's float8 codes times their power-of-two block
scales. The format's own tensors (scales, markers) are dropped and the state dict goes to
diffusers' single-file loader as a dense file would; where the plan keeps the file's scheme,
the loader re-quantises it on the host as for any dense model. BFL's files are not read here:
diffusers' ``bfl`` quantizer loads them (:data:`engine.policy.stored_formats.THROUGH_DIFFUSERS`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from engine.preflight.headers import complete_safetensors_file
from engine.preflight.quant_markers import LayerMarker
from engine.preflight.quantised_linears import FORMATS, MXFP8_BLOCK, NVFP4_BLOCK
from engine.preflight.upstream_files import UpstreamFormat, upstream_format


def decoded_denoiser(denoiser_cls: Any, file: Path, root: Any, subfolder: str, dtype: torch.dtype, *,
                     keep_rotated: bool) -> Any:
    """The denoiser ``file`` stores, decoded and loaded by diffusers' single-file loader (its
    header read once); ``keep_rotated``: ConvRot layers left rotated, their inputs rotated."""
    fmt = stored_format(file)
    model = denoiser_cls.from_single_file(dequantised(file, dtype, fmt, keep_rotated=keep_rotated), config=root,
                                          subfolder=subfolder, dtype=dtype)
    if keep_rotated:
        rotate_as_stored(model, fmt)
    return model


def stored_format(file: Path) -> UpstreamFormat | None:
    """How ``file`` is stored (its header read again: the preflight's checks hold for it)."""
    return upstream_format(file, *complete_safetensors_file(file))


def dequantised(file: Path, dtype: torch.dtype, fmt: UpstreamFormat | None, *,
                keep_rotated: bool = False) -> dict[str, torch.Tensor]:
    """The file's weights in ``dtype``, every quantised Linear decoded as ``fmt`` (its
    :func:`stored_format`) says (``keep_rotated``: a ConvRot layer's values left rotated, for a
    model that rotates its inputs, :func:`rotate_as_stored`)."""
    from safetensors.torch import load_file

    stored = load_file(str(file))
    layers = fmt.layers if fmt is not None else {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if fmt is not None and name in fmt.own:
            continue
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer in layers:
            marker = layers[layer]
            if keep_rotated:
                marker = dataclasses.replace(marker, convrot_group=0)
            tensor = decoded(marker, tensor, {suffix: stored[f"{layer}.{suffix}"] for suffix in FORMATS[marker.format].suffixes
                                              if f"{layer}.{suffix}" in stored})
            tensor = tensor[tuple(slice(0, d) for d in fmt.shapes.get(name, tensor.shape))]  # type: ignore[union-attr]
        state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def rotate_as_stored(model: torch.nn.Module, fmt: UpstreamFormat | None) -> int:
    """Rotate the inputs of each of ``model``'s Linears its file (stored as ``fmt``) holds
    ConvRot-rotated, in its group (their weights were read still rotated); returns how many."""
    from engine.runtime.convrot import rotate_inputs

    layers = {layer: marker.convrot_group for layer, marker in (fmt.layers.items() if fmt else ()) if marker.convrot_group}
    for layer, group in layers.items():
        rotate_inputs(model.get_submodule(layer), group)
    return len(layers)


def decoded(marker: LayerMarker, codes: torch.Tensor, scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """One Linear's weight in fp32 from its ``codes`` and its layer's ``scales`` (by suffix)."""
    fmt = marker.format
    if fmt in ("fp8_scaled", "fp8_e4m3fn"):
        return scaled(codes, scales.get("scale_weight"))
    if fmt in ("float8_e4m3fn", "bfl_fp8r"):
        return scaled(codes, scales["weight_scale"])
    if fmt == "int8_tensorwise":
        weight = scaled(codes, scales["weight_scale"])
        if marker.convrot_group:
            from engine.runtime.convrot import rotated

            weight = rotated(weight, marker.convrot_group)  # the rotation undoes itself
        return weight
    rows, values = codes.shape[0], codes.shape[1] * (2 if fmt.endswith("nvfp4") else 1)
    if fmt in ("nvfp4", "bfl_nvfp4"):
        from diffusers.quantizers.bfl.utils import dequantize_nvfp4

        blocks = scales["weight_scale"]
        if fmt == "nvfp4":  # ComfyUI stores them tiled, as the tensor cores read them
            from torchao.prototype.mx_formats.utils import from_blocked

            blocks = from_blocked(blocks.flatten(), rows, values // NVFP4_BLOCK)
        return dequantize_nvfp4(codes, blocks, scales["weight_scale_2"].float())
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale
    from torchao.prototype.mx_formats.utils import from_blocked

    exponents = from_blocked(scales["weight_scale"].flatten().view(torch.uint8), rows, values // MXFP8_BLOCK)
    return codes.float() * get_fp_scale(exponents).repeat_interleave(MXFP8_BLOCK, dim=1)


def scaled(codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``codes`` times ``scale`` in fp32: one scale for the tensor (a scalar, or of one
    element), or one per output row; no scale: the codes' own values."""
    values = codes.float()
    if scale is None:
        return values
    return values * scale.float().reshape(-1, *([1] * (values.ndim - 1)) if scale.numel() > 1 else ())
