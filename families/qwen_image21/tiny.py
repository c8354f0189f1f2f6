"""Tiny random-weight Qwen-Image 2.1 pipeline for fast, offline tests.

A ``diffusers.QwenImage21Pipeline`` of the family's real classes: the single-stream
``QwenImage21Transformer2DModel`` (two blocks, its block-causal attention and ``causal_condition``
KV cache as the real one), the four-channel ``AutoencoderKLQwenImage21`` (RGBA in and out, 16x in
space, 64 latent channels: the real one's geometry), and a ``Qwen3VLForConditionalGeneration``
of two narrow layers with its vision tower (an edit's references are read by it) and its
``Qwen3VLProcessor``, over a tiny byte-level BPE trained on the pipeline's prompt templates.
"""

from __future__ import annotations

import pathlib

import torch
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline, QwenImage21Transformer2DModel
from transformers import Qwen2VLImageProcessor, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from engine.runtime.processors import without_video
from engine.testing.tiny_qwen3_vl import SPECIAL_TOKENS, qwen3_vl_config, write_video_processor_config
from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_RESOLUTION", "build_tiny_pipeline"]

TINY_RESOLUTION: int = 64
_SEED = 0
_TEXT_DIM = 16
_CORPUS = ["<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n<|im_start|>user\n",
           "<|im_end|>\n<|im_start|>assistant\n", "<image1> <image2> a red fox in the snow", "a lighthouse at dusk"]
#: Qwen3-VL's chat template, as far as the pipeline reads it (it counts the system message's tokens).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _components() -> dict[str, object]:
    tokenizer = qwen_chat_tokenizer(SPECIAL_TOKENS, _CORPUS, chat_template=_CHAT_TEMPLATE)
    torch.manual_seed(_SEED)
    text_encoder = Qwen3VLForConditionalGeneration(qwen3_vl_config(tokenizer, _TEXT_DIM, 2)).eval()
    torch.manual_seed(_SEED)
    transformer = QwenImage21Transformer2DModel(
        in_channels=64, out_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        context_in_dim=_TEXT_DIM, mlp_ratio=2, axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                                   latents_mean=[0.0] * 64, latents_std=[1.0] * 64)
    image_processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=1024,
                                            max_pixels=65536)
    processor = without_video(Qwen3VLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                chat_template=_CHAT_TEMPLATE)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return {"scheduler": scheduler, "vae": vae, "text_encoder": text_encoder, "processor": processor,
            "transformer": transformer}


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``QwenImage21Pipeline`` to ``path``."""
    path = pathlib.Path(path)
    QwenImage21Pipeline(**_components()).save_pretrained(path)
    write_video_processor_config(path / "processor")  # as the real repo ships it
    return path
