"""Tiny random-weight Wan pipelines for fast, offline tests.

Both are ``diffusers.WanPipeline`` folders of the family's real classes
(``WanTransformer3DModel``, ``AutoencoderKLWan``, a ``UMT5EncoderModel`` text
encoder with a locally built Unigram tokenizer, the flow-matching scheduler),
shrunk to a few million parameters so a 2-step, 5-frame, 64 px clip renders in
about a second on CPU.

* :func:`build_tiny_pipeline` is shaped like Wan 2.2 TI2V-5B: the Wan 2.2 VAE
  (48 latent channels, residual, 2x2 patchified inside: 16x spatial and 4x
  temporal compression) and ``expand_timesteps`` (the first latent frame is the
  conditioning image, held clean: text and image to video from one denoiser).
* :func:`build_tiny_two_experts` is shaped like Wan 2.2 T2V-A14B: the Wan 2.1 VAE
  (16 channels, 8x / 4x) and two experts, ``transformer`` for the high-noise
  steps and ``transformer_2`` below the ``boundary_ratio``.

The transformer keeps ``dim`` at 512 (4 heads of 128: Wan's real head width) so
its attention and feed-forward Linears have something for int8 to quantise, and
two blocks, the fewest First-Block-Cache can split into a head and a tail.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from engine.testing.tiny_tokenizers import t5_unigram_tokenizer

__all__ = ["TINY_FRAMES", "TINY_GENERATE_KWARGS", "TINY_RESOLUTION", "build_tiny_pipeline", "build_tiny_two_experts"]

#: A side the tiny pipelines take: a multiple of 32 (the Wan 2.2 VAE's 16x times patch 2).
TINY_RESOLUTION: int = 64
#: Frames of a tiny clip: on the 4k+1 lattice, two latent frames.
TINY_FRAMES: int = 5
#: Extra call kwargs: a short prompt length keeps the tiny UMT5 fast.
TINY_GENERATE_KWARGS: dict[str, Any] = {"max_sequence_length": 32}

_SEED: int = 0
_TEXT_DIM: int = 32


def _tokenizer() -> T5Tokenizer:
    """The T5 Unigram tokenizer the tiny FLUX.1 uses too (UMT5 shares T5's tokenizer class)."""
    return t5_unigram_tokenizer(512)


def _text_encoder(tokenizer: T5Tokenizer) -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=len(tokenizer), d_model=_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(_SEED)
    return UMT5EncoderModel(config).eval()


def _transformer(channels: int) -> WanTransformer3DModel:
    torch.manual_seed(_SEED)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=channels,
        out_channels=channels, text_dim=_TEXT_DIM, freq_dim=256, ffn_dim=512, num_layers=2,
        rope_max_seq_len=1024,
    )


def _wan22_vae() -> AutoencoderKLWan:
    """The Wan 2.2 VAE's shape: 48 channels, residual blocks, patch 2, 16x spatial."""
    torch.manual_seed(_SEED)
    return AutoencoderKLWan(
        base_dim=16, decoder_base_dim=16, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, patch_size=2,
        in_channels=12, out_channels=12,  # 3 colours x the 2x2 patch, as the real config
        latents_mean=[0.0] * 48, latents_std=[1.0] * 48, scale_factor_temporal=4, scale_factor_spatial=16,
    )


def _wan21_vae() -> AutoencoderKLWan:
    torch.manual_seed(_SEED)
    return AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def _save(pipeline: WanPipeline, path: pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny TI2V-5B-shaped ``WanPipeline`` (text and image to video) to ``path``."""
    tokenizer = _tokenizer()
    pipeline = WanPipeline(
        tokenizer=tokenizer, text_encoder=_text_encoder(tokenizer), vae=_wan22_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), transformer=_transformer(48),
        expand_timesteps=True,
    )
    return _save(pipeline, path)


def build_tiny_two_experts(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny T2V-A14B-shaped ``WanPipeline`` (a high- and a low-noise expert) to ``path``."""
    tokenizer = _tokenizer()
    second = _transformer(16)
    with torch.no_grad():  # the experts differ, as the real ones do
        for param in second.parameters():
            param.mul_(0.5)
    pipeline = WanPipeline(
        tokenizer=tokenizer, text_encoder=_text_encoder(tokenizer), vae=_wan21_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=12.0), transformer=_transformer(16),
        transformer_2=second, boundary_ratio=0.875,
    )
    return _save(pipeline, path)
