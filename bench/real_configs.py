"""The published full-size configs the benchmarks build random-weight models from.

Only where a diffusers class's defaults are not the real model: FLUX.1,
Qwen-Image and Z-Image ship their real widths and depths as class defaults
(FLUX.1-dev adds ``guidance_embeds``); SDXL's UNet does not. One copy, shared
by ``planner_accuracy.py``, ``memory_accuracy.py`` and ``gpu_check.py``.
"""

from __future__ import annotations

#: SDXL base 1.0's UNet (2.6B parameters).
SDXL_UNET: dict[str, object] = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time",
    addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
)
