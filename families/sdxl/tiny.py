"""Tiny random-weight SDXL pipeline for tests (no hub access needed).

It uses the real SDXL base parts (``UNet2DConditionModel`` with
``addition_embed_type="text_time"`` and a plain ``DownBlock2D`` first level
followed by cross-attention levels, CLIP-L-like ``CLIPTextModel`` and
CLIP-G-like ``CLIPTextModelWithProjection`` whose penultimate hidden states
are concatenated into the cross-attention input, a 4-channel ``AutoencoderKL``
with SDXL's scaling factor, and SDXL's ``EulerDiscreteScheduler`` settings),
shrunk so that a 2-step 64x64 generate takes a fraction of a second on CPU:

* UNet: three levels of 32/64/128 channels, one resnet and one transformer
  layer per level, ``cross_attention_dim`` 96 (= 32 + 64 text hidden sizes),
  ``sample_size`` 8 so the pipeline's default size is 64x64.
  The time embedding is 512 wide (like SDXL's 1280 = 4 x 320) and the added
  "text_time" input is 6 x 64 + 128 = 512, so ``time_embedding.linear_2``,
  ``add_embedding.linear_1`` and ``add_embedding.linear_2`` are 512x512
  ``Linear`` layers that int8 filters skipping layers under 512 features can
  still quantise. The attention projections stay small on purpose: in a UNet
  their width is the level's channel count, and a 512-channel level (with its
  3x3 convs) costs ~45M parameters (~180 MB), far more than a tiny pipeline
  should;
* VAE: four blocks (scale factor 8, like the real VAE), 32/64 channels;
* text encoders: 2-layer CLIPs (hidden size 32, and 64 with a 128 projection);
* tokenizers: built locally with ``tokenizers``: a byte-level CLIP BPE over
  the 256 byte symbols with no merges (``CLIPTokenizer``), so each prompt is
  split into characters and distinct prompts give distinct ids. Both pad with
  ``<|endoftext|>`` (SDXL's ``tokenizer_2`` pads with ``!``, but a special
  ``!`` pad token would swallow every ``!`` typed in a prompt).

Weights are seeded with ``torch.manual_seed(0)`` before each model, so two
builds are identical.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
)

# Height/width that works: 8x VAE downsampling, then two 2x UNet downsamples,
# so sizes should be multiples of 32. It is also the pipeline's default size.
TINY_RESOLUTION: int = 64

# Extra kwargs for ``pipe(...)``; none are needed, the default guidance works.
TINY_GENERATE_KWARGS: dict[str, Any] = {"guidance_scale": 5.0}

_SEED: int = 0
_CLIP_MAX_LENGTH: int = 77
_TEXT_HIDDEN: int = 32
_TEXT_2_HIDDEN: int = 64
_TEXT_2_PROJECTION: int = 128
_ADDITION_TIME_EMBED_DIM: int = 64
_LATENT_CHANNELS: int = 4


def _clip_tokenizer() -> CLIPTokenizer:
    """Byte-level CLIP BPE over the 256 byte symbols (plus their ``</w>`` forms), no merges."""
    alphabet: list[str] = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    for symbol in alphabet:
        vocab[symbol + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=_CLIP_MAX_LENGTH)


def _clip_config(
    tokenizer: CLIPTokenizer, hidden_size: int, projection_dim: int, hidden_act: str
) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act=hidden_act,
        projection_dim=projection_dim,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    config = _clip_config(tokenizer, _TEXT_HIDDEN, _TEXT_HIDDEN, "quick_gelu")
    torch.manual_seed(_SEED)
    return CLIPTextModel(config).eval()


def _text_encoder_2(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    config = _clip_config(tokenizer, _TEXT_2_HIDDEN, _TEXT_2_PROJECTION, "gelu")
    torch.manual_seed(_SEED)
    return CLIPTextModelWithProjection(config).eval()


def _unet() -> UNet2DConditionModel:
    torch.manual_seed(_SEED)
    return UNet2DConditionModel(
        sample_size=TINY_RESOLUTION // 8,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64, 128),
        layers_per_block=1,
        transformer_layers_per_block=(1, 1, 1),
        attention_head_dim=(2, 4, 8),
        norm_num_groups=32,
        cross_attention_dim=_TEXT_HIDDEN + _TEXT_2_HIDDEN,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=_ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=6 * _ADDITION_TIME_EMBED_DIM + _TEXT_2_PROJECTION,
        time_embedding_dim=512,
    ).eval()


def _vae() -> AutoencoderKL:
    torch.manual_seed(_SEED)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 64, 64),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=32,
        sample_size=TINY_RESOLUTION,
        scaling_factor=0.13025,
        force_upcast=True,
    ).eval()


def _scheduler() -> EulerDiscreteScheduler:
    return EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        interpolation_type="linear",
        use_karras_sigmas=False,
        timestep_spacing="leading",
        steps_offset=1,
    )


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny random-weight ``StableDiffusionXLPipeline`` to ``path`` (created) and return ``path``."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _clip_tokenizer()
    tokenizer_2 = _clip_tokenizer()
    pipeline = StableDiffusionXLPipeline(
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        text_encoder_2=_text_encoder_2(tokenizer_2),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=_unet(),
        scheduler=_scheduler(),
        add_watermarker=False,
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return path
