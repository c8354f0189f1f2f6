"""A single file its publisher stored quantised, read into the dense model's weights.

ComfyUI's ``fp8_scaled``: each float8 weight times its ``scale_weight`` (a scalar, or one per
row), the format's own tensors (``scaled_fp8``, ``scale_input``) dropped; a plain fp8 cast: its
codes as they are. The state dict goes to diffusers' single-file loader as a dense file would.
Where the plan keeps the model fp8, the loader then quantises it on the host as for any dense
model: the float8 values re-laid per row as torchao tensors, never dense on the device. The
preflight checked every scale (:mod:`engine.preflight.upstream_files`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.preflight.upstream_files import is_format_tensor


def dequantised(file: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file's weights in ``dtype``: each float8 weight times its scale."""
    from safetensors.torch import load_file

    stored = load_file(str(file))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if is_format_tensor(name):
            continue
        scale = stored.get(name.removesuffix(".weight") + ".scale_weight") if name.endswith(".weight") else None
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            tensor = scaled(tensor, scale)
        state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def scaled(codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float8 ``codes`` times ``scale`` in fp32: one scale for the tensor (a scalar, or of one
    element), or one per output row; no scale: the codes' own values."""
    values = codes.float()
    if scale is None:
        return values
    return values * scale.float().reshape(-1, *([1] * (values.ndim - 1)) if scale.numel() > 1 else ())
