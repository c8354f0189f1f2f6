"""Tiny random-weight HunyuanVideo 1.5 pipeline for fast, offline tests.

A ``diffusers.HunyuanVideo15Pipeline`` of the family's real classes: the
``HunyuanVideo15Transformer3DModel`` (two blocks of 4 heads x 64, one refiner block), the 16x / 4x
``AutoencoderKLHunyuanVideo15`` (32 latent channels), a ``Qwen2_5_VLTextModel`` text
encoder with a byte-level BPE ``Qwen2Tokenizer`` and a chat template (the pipeline
applies one), the ByT5 glyph encoder (``T5EncoderModel`` + ``ByT5Tokenizer``, which
needs no files), the flow-matching scheduler and the ``ClassifierFreeGuidance``
guider that holds its guidance. A 2-step, 5-frame, 64 px clip renders in seconds on CPU.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import ByT5Tokenizer, Qwen2Tokenizer, T5Config, T5EncoderModel
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
from transformers.models.qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

__all__ = ["TINY_RESOLUTION", "build_tiny_pipeline"]

TINY_RESOLUTION: int = 64
_SEED = 0
_TEXT_DIM = 32
_GLYPH_DIM = 32
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> Qwen2Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=512, min_frequency=1, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(["system user assistant", "a red fox runs in the snow"], trainer=trainer)
    model: dict[str, Any] = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": _SPECIAL[1:]})
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``HunyuanVideo15Pipeline`` (480p-shaped) to ``path``."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    torch.manual_seed(_SEED)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    )).eval()
    glyph_tokenizer = ByT5Tokenizer()
    torch.manual_seed(_SEED)
    glyph_encoder = T5EncoderModel(T5Config(
        vocab_size=len(glyph_tokenizer), d_model=_GLYPH_DIM, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        pad_token_id=glyph_tokenizer.pad_token_id, eos_token_id=glyph_tokenizer.eos_token_id,
    )).eval()
    torch.manual_seed(_SEED)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=65, out_channels=32, num_attention_heads=4, attention_head_dim=64, num_layers=2,
        num_refiner_layers=1, text_embed_dim=_TEXT_DIM, text_embed_2_dim=_GLYPH_DIM, image_embed_dim=32,
        rope_axes_dim=(16, 24, 24), target_size=TINY_RESOLUTION, task_type="t2v",
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=32, block_out_channels=(16, 16, 32, 32, 32), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4)
    pipeline = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=glyph_encoder,
        tokenizer_2=glyph_tokenizer, guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return path
