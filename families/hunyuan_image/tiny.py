"""Tiny random-weight HunyuanImage 2.1 pipeline for fast, offline tests.

A ``diffusers.HunyuanImagePipeline`` of the family's real classes: the
``HunyuanImageTransformer2DModel`` (one double-, one single-stream block and one refiner, its
patch of 1), the 32x ``AutoencoderKLHunyuanImage`` (64 latent channels, as the real one), the
Qwen2.5-VL encoder (``Qwen2_5_VLForConditionalGeneration``, three narrow layers: the pipeline
reads the third from last) with its tokenizer, the ByT5 glyph encoder (a ``T5EncoderModel`` with
the byte-level ``ByT5Tokenizer``: quoted text in a prompt is read by it), and the repo's two
``AdaptiveProjectedMixGuidance`` guiders (real CFG at 3.5, and the one for prompts with text).
"""

from __future__ import annotations

import pathlib

import torch
from diffusers import (
    AdaptiveProjectedMixGuidance,
    AutoencoderKLHunyuanImage,
    FlowMatchEulerDiscreteScheduler,
    HunyuanImagePipeline,
    HunyuanImageTransformer2DModel,
)
from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

from families.qwen_image.tiny import _build_text_encoder, _build_tokenizer

__all__ = ["TINY_RESOLUTION", "build_tiny_pipeline"]

TINY_RESOLUTION: int = 64
_SEED = 0
_QWEN_DIM = 32  # families.qwen_image.tiny's encoder width
_BYT5_DIM = 16


def _byt5() -> tuple[T5EncoderModel, ByT5Tokenizer]:
    tokenizer = ByT5Tokenizer()
    torch.manual_seed(_SEED)
    model = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=_BYT5_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )).eval()
    return model, tokenizer


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``HunyuanImagePipeline`` to ``path``."""
    path = pathlib.Path(path)
    tokenizer = _build_tokenizer()
    torch.manual_seed(_SEED)
    text_encoder = _build_text_encoder(tokenizer, layers=3)
    byt5, byt5_tokenizer = _byt5()
    torch.manual_seed(_SEED)
    transformer = HunyuanImageTransformer2DModel(
        in_channels=64, out_channels=64, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, text_embed_dim=_QWEN_DIM, text_embed_2_dim=_BYT5_DIM,
        rope_axes_dim=(8, 8),
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=64,
                                    block_out_channels=(32, 32, 32, 64, 128, 128), layers_per_block=1,
                                    spatial_compression_ratio=32, sample_size=TINY_RESOLUTION, scaling_factor=0.75289)
    HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=byt5, tokenizer_2=byt5_tokenizer, transformer=transformer,
        guider=AdaptiveProjectedMixGuidance(guidance_scale=3.5), ocr_guider=AdaptiveProjectedMixGuidance(guidance_scale=3.5),
    ).save_pretrained(path)
    return path
