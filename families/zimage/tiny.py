"""Tiny random-weight Z-Image pipeline for fast, offline tests.

Builds a ``diffusers.ZImagePipeline`` with the family's real component classes
(``ZImageTransformer2DModel``, a flux-style 16-channel ``AutoencoderKL``, a
``transformers.Qwen3Model`` text encoder, a byte-level BPE ``Qwen2Tokenizer`` with a
chat template, and ``FlowMatchEulerDiscreteScheduler``) shrunk to a few million
parameters, so a 2-step 64x64 generate runs in well under a second on CPU.

Shape choices and why:

* Transformer: ``dim=512`` with 4 heads of 128 (real: 3840, 30 x 128), one main
  layer and one noise/context refiner layer each (real: 30 and 2). 512 keeps the
  attention / feed-forward ``nn.Linear`` layers at >= 512 in and out features so int8
  quantisation filters have something to quantise. ``axes_dims=[32, 48, 48]`` sums to
  the head dim as required, and ``axes_lens=[1536, 512, 512]`` (the real values)
  covers the RoPE positions used: captions take axis-0 positions ``1..L`` (``L`` =
  caption tokens padded to a multiple of 32, up to ``max_sequence_length``), the image
  starts at ``L + 1``; axes 1/2 index latent patch rows/columns.
* VAE: flux-like ``AutoencoderKL`` with 16 latent channels and 4 levels (8x spatial),
  but narrow channels and one layer per block. Latents are patchified 2x2, so height
  and width must be multiples of 16.
* Text encoder: 2-layer ``Qwen3Model`` with hidden size 32 (== transformer
  ``cap_feat_dim``); the pipeline takes ``hidden_states[-2]``.
* Tokenizer: built locally (no hub) by training a byte-level BPE with Qwen2's
  pre-tokenizer on a tiny corpus; any text tokenises through the byte alphabet.
  The pipeline calls ``apply_chat_template(..., enable_thinking=True)``, so a minimal
  Qwen3-style chat template is attached.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import Qwen3Config, Qwen3Model

from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_GENERATE_KWARGS", "TINY_RESOLUTION", "build_tiny_pipeline"]

#: Works for the tiny pipeline; any multiple of 16 (VAE 8x * 2x2 patches) does.
TINY_RESOLUTION: int = 64

#: Extra ``ZImagePipeline.__call__`` kwargs. ``guidance_scale=0.0`` is the Z-Image-Turbo
#: setting (no CFG, one transformer pass per step); the pipeline default 5.0 also works.
#: ``max_sequence_length`` is the padded tokenizer length (default 512).
TINY_GENERATE_KWARGS: dict[str, Any] = {"guidance_scale": 0.0, "max_sequence_length": 64}

_TEXT_HIDDEN: int = 32


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny random-weight ``ZImagePipeline`` to ``path`` and return ``path``.

    Weights are deterministic (``torch.manual_seed(0)`` before each model).
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = qwen_chat_tokenizer()

    torch.manual_seed(0)
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,  # Qwen3Config defaults to 128 regardless of hidden_size
            max_position_embeddings=2048,
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        )
    ).eval()

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=512,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=_TEXT_HIDDEN,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[32, 48, 48],
        axes_lens=[1536, 512, 512],
    )
    # Older diffusers created the pad tokens with torch.empty; pin them for determinism.
    with torch.no_grad():
        transformer.x_pad_token.zero_()
        transformer.cap_pad_token.zero_()

    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[32, 32, 64, 64],
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=32,
        sample_size=TINY_RESOLUTION,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

    pipeline = ZImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return path
