"""Ideogram 4's torch code: its fp8 repo's transformers read into diffusers' layout.

Ideogram's fp8 repo stores each block's Linears as float8_e4m3fn with a per-output-channel
``weight_scale`` (the weight is ``fp8 * scale`` row by row), q, k and v fused into one
``attention.qkv`` and the output projection as ``attention.o``: the original model's names.
diffusers' ``Ideogram4Transformer2DModel`` has ``to_q`` / ``to_k`` / ``to_v`` / ``to_out.0``, so a
plain ``from_pretrained`` drops the fused tensors and random-initialises the attention (with a
log line, nothing more), and reads the other fp8 weights without their scales. The engine
recognises the layout from the headers (``QuantRules.stored_layouts``) and loads the state dict
:func:`split_fused_fp8` gives, strictly.
"""

from __future__ import annotations

import re

import torch

from engine.runtime.upstream_files import scaled

_SCALE = ".weight_scale"
_FUSED = re.compile(r"^(layers\.\d+\.attention)\.qkv\.weight$")
_OUT = re.compile(r"^(layers\.\d+\.attention)\.o\.weight$")


def split_fused_fp8(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """diffusers' state dict in ``dtype``: every weight with a ``weight_scale`` beside it
    dequantised (``weight * scale`` per output channel), each fused ``qkv`` split in three
    (q, k, v in that order, as the fused rows are), each ``o`` renamed ``to_out.0``."""
    scales = {key.removesuffix(_SCALE): state[key] for key in state if key.endswith(_SCALE)}
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.endswith(_SCALE):
            continue
        module = key.removesuffix(".weight")
        if module in scales:
            tensor = scaled(tensor, scales[module])
        tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        if fused := _FUSED.match(key):
            for part, rows in zip(("to_q", "to_k", "to_v"), tensor.chunk(3, dim=0)):
                converted[f"{fused.group(1)}.{part}.weight"] = rows.contiguous()
        elif out := _OUT.match(key):
            converted[f"{out.group(1)}.to_out.0.weight"] = tensor
        else:
            converted[key] = tensor
    return converted
