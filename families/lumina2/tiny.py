"""Tiny random-weight Lumina 2 pipeline for fast, offline tests.

A ``diffusers.Lumina2Pipeline`` of the family's real classes: the ``Lumina2Transformer2DModel``
(two joint blocks, one refiner each), an 8x ``AutoencoderKL`` (4 channels: the pipeline's
``vae_scale_factor`` is a fixed 8), a ``Gemma2Model`` text encoder of two narrow layers and a
character-level ``GemmaTokenizerFast`` built with ``tokenizers``.
"""

from __future__ import annotations

import pathlib

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
from transformers import Gemma2Config, Gemma2Model

from engine.testing.tiny_tokenizers import gemma_char_tokenizer

__all__ = ["TINY_RESOLUTION", "build_tiny_pipeline"]

TINY_RESOLUTION: int = 64
_SEED = 0
_TEXT_DIM = 16


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``Lumina2Pipeline`` to ``path``."""
    path = pathlib.Path(path)
    tokenizer = gemma_char_tokenizer()
    torch.manual_seed(_SEED)
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=_TEXT_DIM, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512, sliding_window=64,
        pad_token_id=tokenizer.pad_token_id,
    )).eval()
    torch.manual_seed(_SEED)
    transformer = Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(300, 64, 64),
        cap_feat_dim=_TEXT_DIM,
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159,
    )
    Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
                    vae=vae, text_encoder=text_encoder, tokenizer=tokenizer).save_pretrained(path)
    return path
