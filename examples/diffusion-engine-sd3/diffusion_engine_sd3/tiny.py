"""A tiny random-weight Stable Diffusion 3 pipeline, built locally (no hub).

The real architecture, shrunk: ``SD3Transformer2DModel`` with one joint
block (4 heads x 8), a 16-channel VAE with SD3's shift and scaling factors,
two CLIP text encoders with projection (hidden 32 each, pooled 64) and a
T5 encoder (d_model 64), and SD3's flow-matching Euler scheduler (shift 3).
Tokenizers are built with ``tokenizers``: a byte-level CLIP BPE with no
merges and a character-level T5 Unigram, so distinct prompts give distinct
ids. Weights are seeded, so two builds are identical. A 2-step 64x64
generate takes well under a second on a CPU.
"""

from __future__ import annotations

import pathlib
import string

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

#: Image sides the tiny pipeline is meant for (a multiple of 16).
TINY_RESOLUTION = 64
_SEED = 0
_CLIP_HIDDEN = 32
_T5_D_MODEL = 64  # >= both CLIPs side by side: SD3 pads the CLIP embeddings to it
_LATENT_CHANNELS = 16


def clip_tokenizer() -> CLIPTokenizer:
    """Byte-level CLIP BPE over the 256 byte symbols (and their ``</w>`` forms), no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab.update({symbol + "</w>": len(alphabet) + i for i, symbol in enumerate(alphabet)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer() -> T5Tokenizer:
    """Unigram over printable ASCII characters (and their word-initial forms)."""
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=256)


def _clip(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    torch.manual_seed(_SEED)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=_CLIP_HIDDEN, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
        hidden_act="quick_gelu", projection_dim=_CLIP_HIDDEN,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )).eval()


def _t5(tokenizer: T5Tokenizer) -> T5EncoderModel:
    torch.manual_seed(_SEED)
    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=_T5_D_MODEL, d_kv=16, d_ff=64, num_layers=1,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )).eval()


def transformer() -> SD3Transformer2DModel:
    torch.manual_seed(_SEED)
    return SD3Transformer2DModel(
        sample_size=TINY_RESOLUTION // 8, patch_size=2, in_channels=_LATENT_CHANNELS,
        num_layers=1, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=_T5_D_MODEL, caption_projection_dim=32,
        pooled_projection_dim=2 * _CLIP_HIDDEN, out_channels=_LATENT_CHANNELS, pos_embed_max_size=32,
    ).eval()


def _vae() -> AutoencoderKL:
    torch.manual_seed(_SEED)
    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 32, 32), layers_per_block=1, latent_channels=_LATENT_CHANNELS,
        norm_num_groups=32, sample_size=TINY_RESOLUTION, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def build_pipeline(denoiser: torch.nn.Module | None = None) -> StableDiffusion3Pipeline:
    """The tiny pipeline in memory (``denoiser`` replaces the transformer, for tests)."""
    tokenizers = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    return StableDiffusion3Pipeline(
        transformer=denoiser if denoiser is not None else transformer(),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=_vae(),
        text_encoder=_clip(tokenizers[0]), tokenizer=tokenizers[0],
        text_encoder_2=_clip(tokenizers[1]), tokenizer_2=tokenizers[1],
        text_encoder_3=_t5(tokenizers[2]), tokenizer_3=tokenizers[2],
    )


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write the tiny ``StableDiffusion3Pipeline`` to ``path`` (created) and return it."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_pipeline().save_pretrained(path, safe_serialization=True)
    return path
