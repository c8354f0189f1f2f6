"""The published full-size configs the benchmarks build random-weight models from.

Only where a diffusers class's defaults are not the real model: FLUX.1,
Qwen-Image and Z-Image ship their real widths and depths as class defaults
(FLUX.1-dev adds ``guidance_embeds``); SDXL's UNet does not. One copy, shared
by ``planner_accuracy.py``, ``memory_accuracy.py`` and ``gpu_check.py``.
"""

from __future__ import annotations

#: SDXL base 1.0's UNet (2.6B parameters): kept in the family's table, beside its memory probe.
from families.sdxl.table import SDXL_UNET  # noqa: E402

__all__ = ["SDXL_UNET"]
