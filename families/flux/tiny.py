"""Tiny random-weight FLUX pipeline for tests (no hub access needed).

It uses the real FLUX.1-dev parts (``FluxTransformer2DModel`` with guidance
embeds, a 16-channel ``AutoencoderKL`` with FLUX's shift and scaling factors
and no quant convs, CLIP-L + T5 text encoders and a dynamic-shift
``FlowMatchEulerDiscreteScheduler``), shrunk so that a 2-step 64x64 generate
takes a fraction of a second on CPU:

* transformer: 1 double-stream + 1 single-stream block, 4 heads x 128 head dim
  (inner dim 512, rope axes ``(16, 56, 56)`` like the real model). 512 is the
  smallest width that keeps the attention/MLP ``Linear`` layers at >= 512 in and
  out features, so int8 quantisation filters that skip small layers still have
  something to quantise;
* VAE: four blocks (scale factor 8, like the real VAE), 32/64 channels;
* text encoders: 2-layer CLIP (hidden size 32) and 2-layer T5 (d_model 32);
* tokenizers: built locally with ``tokenizers``. The CLIP one is a byte-level
  BPE over the 256 byte symbols with no merges (``CLIPTokenizer``); the T5 one
  is a Unigram model over printable ASCII characters (``T5Tokenizer``). So
  each prompt is split into characters and distinct prompts give distinct ids.

Weights are seeded with ``torch.manual_seed(0)`` before each model, so two
builds are identical.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from engine.testing.tiny_tokenizers import t5_unigram_tokenizer

# Height/width that works: FLUX latents are packed 2x2 after the VAE's 8x
# downsampling, so sizes must be multiples of 16.
TINY_RESOLUTION: int = 64

# Extra kwargs for ``pipe(...)``. The default ``max_sequence_length`` (512)
# works but pads the character-level T5 prompt to 512 tokens; 64 keeps it fast.
# FluxPipeline's default height/width (1024) comes from a hard-coded sample
# size, so callers must pass height/width themselves.
TINY_GENERATE_KWARGS: dict[str, Any] = {"max_sequence_length": 64, "guidance_scale": 3.5}

_SEED: int = 0
_CLIP_MAX_LENGTH: int = 77
_T5_MAX_LENGTH: int = 512
_CLIP_HIDDEN: int = 32
_T5_D_MODEL: int = 32
_LATENT_CHANNELS: int = 16


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


def _t5_tokenizer() -> T5Tokenizer:
    """Unigram over printable ASCII characters (and their word-initial ``▁`` forms)."""
    return t5_unigram_tokenizer(_T5_MAX_LENGTH)


def _clip_text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act="quick_gelu",
        projection_dim=_CLIP_HIDDEN,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(_SEED)
    return CLIPTextModel(config).eval()


def _t5_text_encoder(tokenizer: T5Tokenizer) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=_T5_D_MODEL,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(_SEED)
    return T5EncoderModel(config).eval()


def _transformer() -> FluxTransformer2DModel:
    torch.manual_seed(_SEED)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=_LATENT_CHANNELS * 4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=_T5_D_MODEL,
        pooled_projection_dim=_CLIP_HIDDEN,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
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
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
        force_upcast=True,
        mid_block_add_attention=True,
    ).eval()


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny random-weight ``FluxPipeline`` to ``path`` (created) and return ``path``."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _clip_tokenizer()
    tokenizer_2 = _t5_tokenizer()
    pipeline = FluxPipeline(
        scheduler=_scheduler(),
        vae=_vae(),
        text_encoder=_clip_text_encoder(tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=_t5_text_encoder(tokenizer_2),
        tokenizer_2=tokenizer_2,
        transformer=_transformer(),
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_controlnet(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny random-weight ``FluxControlNetModel`` to ``path``: the tiny
    transformer's config (one double-stream block, no single-stream ones),
    its embedders copied from it as ``from_transformer`` does."""
    from diffusers import FluxControlNetModel

    controlnet = FluxControlNetModel.from_transformer(
        _transformer(), num_layers=1, num_single_layers=0, attention_head_dim=128, num_attention_heads=4,
    ).eval()
    # A new ControlNet's output projections start at zero (training grows the
    # control from nothing); random ones make the tiny model steer the image.
    torch.manual_seed(_SEED)
    with torch.no_grad():
        for linear in [*controlnet.controlnet_blocks, controlnet.controlnet_x_embedder]:
            linear.weight.normal_(0.0, 0.2)
    controlnet.save_pretrained(path, safe_serialization=True)
    return pathlib.Path(path)
