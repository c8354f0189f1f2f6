"""Tiny random-weight Krea 2 pipeline for fast, offline tests.

A ``diffusers.Krea2Pipeline`` of the family's real classes: the ``Krea2Transformer2DModel``
(two blocks, its text fusion and refiner one each), the Qwen-Image VAE
(``AutoencoderKLQwenImage``: 8x, 16 channels, as the real one) and a ``Qwen3VLModel`` text
encoder of four narrow layers, the pipeline tapping two of them (the real one taps twelve
of Qwen3-VL-4B's 36), with a tiny byte-level BPE trained on the pipeline's prompt template.
``build_tiny_turbo_pipeline`` writes the distilled variant (``is_distilled``: the Turbo's
fixed schedule shift) under a name the Turbo checkpoint matches.
"""

from __future__ import annotations

import pathlib

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
from transformers import Qwen3VLModel

from engine.testing.tiny_qwen3_vl import SPECIAL_TOKENS, qwen3_vl_config
from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_RESOLUTION", "build_tiny_pipeline", "build_tiny_turbo_pipeline"]

TINY_RESOLUTION: int = 64
_SEED = 0
_TEXT_DIM = 16
#: The encoder layers the tiny pipeline taps (its config's ``text_encoder_select_layers``).
_TAPS = (2, 4)
_CORPUS = [
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    "<|im_end|>\n<|im_start|>assistant\n", "a red fox in the snow", "a lighthouse at dusk",
]


def _text_encoder(tokenizer: object) -> Qwen3VLModel:
    return Qwen3VLModel(qwen3_vl_config(tokenizer, _TEXT_DIM, 4)).eval()


def _pipeline(distilled: bool) -> Krea2Pipeline:
    tokenizer = qwen_chat_tokenizer(SPECIAL_TOKENS, _CORPUS)
    torch.manual_seed(_SEED)
    text_encoder = _text_encoder(tokenizer)
    torch.manual_seed(_SEED)
    transformer = Krea2Transformer2DModel(
        in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=_TEXT_DIM, num_text_layers=len(_TAPS),
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=32,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    return Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True), vae=vae,
                         text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                         text_encoder_select_layers=_TAPS, is_distilled=distilled)


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``Krea2Pipeline`` (Raw: the schedule shifted by the image's size) to ``path``."""
    path = pathlib.Path(path)
    _pipeline(distilled=False).save_pretrained(path)
    return path


def build_tiny_turbo_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write the tiny Turbo (``is_distilled``: its fixed shift) to ``path``."""
    path = pathlib.Path(path)
    _pipeline(distilled=True).save_pretrained(path)
    return path
