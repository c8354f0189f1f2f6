"""Write a tiny pipeline's denoiser as publishers ship quantised single files.

Each writer lays the block Linears out exactly as its format's publisher does (ComfyUI's
per-layer ``comfy_quant`` markers with float8, ConvRot int8, nvfp4 and mxfp8 codes and their
scales, the block scales tiled as the tensor cores read them; Black Forest Labs' FP8R and
NVFP4 linears) and, beside it, the dense file holding the values those codes encode, so a test
can ask that the engine renders the quantised file as the dense model it is. The codes are
made by the libraries that define them where one does (diffusers' BFL quantizer for fp8r and
nvfp4, torchao's MX quantiser and tile layout for mxfp8), so the files are not the engine's
own reading of itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.testing.checkpoints import denoiser_state_dict, fp8_rounded

#: What each writer lays out: the formats of ComfyUI's markers, then BFL's.
COMFY = ("float8_e4m3fn", "int8_tensorwise", "int8_convrot", "nvfp4", "mxfp8")
BFL = ("bfl_fp8r", "bfl_nvfp4")


def write_upstream(pipeline_dir: Path, denoiser: str, target: Path, fmt: str, dense: Path | None = None,
                   *, group: int = 256, in_metadata: bool = False) -> Path:
    """``target``: the denoiser with every 2-D weight of its blocks stored in ``fmt`` (ConvRot
    int8 rotated in groups of ``group`` inputs; ``in_metadata``: ComfyUI's markers in the
    file's ``__metadata__`` rather than as tensors); ``dense``: the values they encode."""
    from safetensors.torch import save_file

    stored: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}
    markers: dict[str, dict[str, object]] = {}
    for name, weight in denoiser_state_dict(pipeline_dir, denoiser).items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and weight.ndim == 2 and "blocks" in name and weight.shape[1] % 32 == 0):
            stored[name] = held[name] = weight
            continue
        codes, scales, values = _encoded(weight, fmt, group)
        stored[name], held[name] = codes, values.to(weight.dtype)
        stored.update({f"{layer}.{suffix}": scale for suffix, scale in scales.items()})
        if fmt in COMFY:
            markers[layer] = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group} \
                if fmt == "int8_convrot" else {"format": fmt}
    metadata = None
    if in_metadata:
        metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": markers})}
    else:
        stored.update({f"{layer}.comfy_quant": marker_tensor(marker) for layer, marker in markers.items()})
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(target), metadata=metadata)
    if dense is not None:
        dense.parent.mkdir(parents=True, exist_ok=True)
        save_file(held, str(dense))
    return target


def marker_tensor(marker: dict[str, object]) -> torch.Tensor:
    """A ComfyUI per-layer marker: its JSON as a ``uint8`` vector."""
    return torch.tensor(list(json.dumps(marker).encode()), dtype=torch.uint8)


def _encoded(weight: torch.Tensor, fmt: str, group: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(codes, scales by suffix, the fp32 values they hold) of ``weight`` in ``fmt``."""
    from diffusers.quantizers.bfl.utils import dequantize_fp8r, dequantize_nvfp4, quantize_fp8r, quantize_nvfp4

    if fmt == "float8_e4m3fn":
        codes, scale, values = fp8_rounded(weight.float(), per_row=False)
        return codes, {"weight_scale": scale}, values
    if fmt in ("int8_tensorwise", "int8_convrot"):
        return _int8(weight.float(), group if fmt == "int8_convrot" else 0)
    if fmt == "bfl_fp8r":
        codes, scale = quantize_fp8r(weight)
        return codes, {"weight_scale": scale}, dequantize_fp8r(codes, scale)
    if fmt in ("nvfp4", "bfl_nvfp4"):
        codes, blocks, global_scale = quantize_nvfp4(weight)
        values = dequantize_nvfp4(codes, blocks, global_scale)
        if fmt == "bfl_nvfp4":
            return codes, {"weight_scale": blocks, "weight_scale_2": global_scale,
                           "input_scale": torch.tensor(1.0)}, values
        return codes, {"weight_scale": _tiled(blocks), "weight_scale_2": global_scale.reshape(())}, values
    if fmt == "mxfp8":
        from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

        exponents, codes = to_mx(weight.float().contiguous(), torch.float8_e4m3fn, 32)
        values = codes.float() * get_fp_scale(exponents).repeat_interleave(32, dim=1)
        return codes, {"weight_scale": _tiled(exponents.view(torch.uint8))}, values
    raise ValueError(f"no writer for {fmt!r}")


def _int8(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Per-row symmetric int8 of ``weight``, rotated first in ConvRot groups of ``group``."""
    from engine.runtime.convrot import rotated

    stored = rotated(weight, group) if group else weight
    scale = stored.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    codes = torch.round(stored / scale).clamp(-128, 127).to(torch.int8)
    values = codes.float() * scale
    return codes, {"weight_scale": scale}, rotated(values, group) if group else values


def _tiled(blocks: torch.Tensor) -> torch.Tensor:
    """Block scales ``rows x blocks`` in the tensor cores' 128 x 4 tiles, as a padded matrix."""
    from torchao.prototype.mx_formats.utils import ceil_div, to_blocked

    rows, cols = blocks.shape
    raw = to_blocked(blocks.view(torch.uint8))
    return raw.reshape(ceil_div(rows, 128) * 128, ceil_div(cols, 4) * 4).view(blocks.dtype)
