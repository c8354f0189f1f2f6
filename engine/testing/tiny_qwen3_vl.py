"""A tiny Qwen3-VL configuration for the families whose text encoder it is (tests only).

Several families condition on a Qwen3-VL model's hidden states (one tapped layer, or several
stacked): their tiny pipelines build the same narrow model, differing only in depth (a family
reading hidden state 50 needs 51 layers). Its tokenizer is :func:`qwen_chat_tokenizer` with the
vision tokens the config names (:data:`SPECIAL_TOKENS`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The tokenizer's special tokens: the pad first, then the chat and vision tokens the config names.
SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                             "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def qwen3_vl_config(tokenizer: Any, hidden: int, layers: int) -> Any:
    """A ``Qwen3VLConfig`` of ``layers`` text layers ``hidden`` wide (heads of 8), a one-block vision
    tower projecting to that width, and ``tokenizer``'s ids for its special tokens."""
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids
    return Qwen3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": layers, "num_attention_heads": hidden // 8, "num_key_value_heads": 1,
                     "head_dim": 8, "max_position_embeddings": 2048, "pad_token_id": ids("<|endoftext|>"),
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [1, 1, 2],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": []},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )


def write_video_processor_config(processor_folder: Path) -> None:
    """The video processor's config beside a saved ``Qwen3VLProcessor``, as the real repos ship
    it: transformers builds that part only with torchvision, so a processor saved without it
    (:func:`engine.runtime.processors.without_video`) writes none."""
    (Path(processor_folder) / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor", "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }, indent=2), encoding="utf-8")
