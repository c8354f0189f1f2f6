"""A pipeline folder whose denoiser ``diffusion-engine quantize`` stored quantised, read torch-free.

The denoiser folder holds :data:`MARKER` beside diffusers' ``config.json``: the
scheme, the device it was quantised for, the folder it was made from and its
dense size (so the plan sizes it as the scheme it is). The weights are torchao
tensors flattened into :data:`WEIGHTS` (:mod:`engine.runtime.prequantised`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The denoiser folder's note of what it holds (the engine's, beside diffusers' config.json).
MARKER = "diffusion_engine_quantized.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
#: Schemes stored this way (torchao's safetensors support covers their tensor types).
STORED_SCHEMES: tuple[str, ...] = ("int8", "fp8")


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a pre-quantised denoiser folder (None: not one, or not readable as one)."""
    try:
        data = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("scheme") not in STORED_SCHEMES:
        return None
    return data


__all__ = ["MARKER", "STORED_SCHEMES", "WEIGHTS", "read_marker"]
