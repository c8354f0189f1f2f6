"""Tiny random-weight MiniMax-H3 modular pipeline for fast, offline tests.

A ``diffusers.MiniMaxH3ModularPipeline`` of the family's real classes, saved as its repo is
(``modular_model_index.json`` and a folder per component): the ``MiniMaxH3Transformer3DModel``
(two blocks, one refiner), the ``AutoencoderKLMiniMaxH3`` video VAE (16x in space, 17 frames
into 5 latents, as the real one), the ``AutoencoderKLMiniMaxH3Audio`` (hop 800 at 32 kHz: 40
latents a second, as the real one), the two ``MiniMaxH3Scheduler`` (shift 12 and 3) and a
``Qwen3VLForConditionalGeneration`` of 51 narrow layers (MiniMax-H3 reads hidden state 50)
with a tiny byte-level BPE and its ``Qwen3VLProcessor``. The index's loading specs name the
published repo, as a download's do, so a test proves the engine loads from the folder only.
A 2-step, 124-frame (5 s), 64 px clip with its sound renders in about a second on the CPU.
"""

from __future__ import annotations

import json
import pathlib

import torch
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3ModularPipeline,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from transformers import Qwen2VLImageProcessor, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from engine.preflight.pipeline_index import MODULAR_INDEX
from engine.runtime.processors import without_video
from engine.testing.tiny_qwen3_vl import SPECIAL_TOKENS, qwen3_vl_config, write_video_processor_config
from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_FRAMES", "TINY_RESOLUTION", "build_tiny_pipeline"]

TINY_RESOLUTION: int = 64
#: Frames of a tiny clip: the shortest MiniMax-H3 renders (5 s at 24 fps, on its 17k+5 lattice).
TINY_FRAMES: int = 124
_SEED = 0
_TEXT_DIM = 16
_CORPUS = ["a red fox runs through the snow", "a cat", "<Picture 1>: "]
#: Where the published repo's index says each component comes from.
_PUBLISHED = "MiniMaxAI/MiniMax-H3"


def _text_encoder(tokenizer: object) -> Qwen3VLForConditionalGeneration:
    return Qwen3VLForConditionalGeneration(qwen3_vl_config(tokenizer, _TEXT_DIM, 51)).eval()


def _components() -> dict[str, object]:
    tokenizer = qwen_chat_tokenizer(SPECIAL_TOKENS, _CORPUS)
    torch.manual_seed(_SEED)
    text_encoder = _text_encoder(tokenizer)
    torch.manual_seed(_SEED)
    transformer = MiniMaxH3Transformer3DModel(  # heads of 12: the rotary embedding turns 6 x rope_freq_dim channels
        num_attention_heads=2, attention_head_dim=12, hidden_size=24, num_layers=2, num_refiner_layers=1, ffn_dim=32,
        in_channels=4, audio_in_channels=4, text_dim=_TEXT_DIM, freq_dim=16, time_embed_hidden_dim=16,
        time_embed_dim=8, rope_freq_dim=2,
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=4, block_out_channels=(8,) * 6, layers_per_block=1, norm_num_groups=4, decoder_num_layers=1,
        decoder_num_attention_heads=2, decoder_attention_head_dim=8, decoder_num_register_tokens=1,
        decoder_ffn_mult=1, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4,
    )
    torch.manual_seed(_SEED)
    audio_vae = AutoencoderKLMiniMaxH3Audio(  # the real hop (800) and rate: 40 latents a second
        encoder_dim=2, latent_dim=8, latent_channels=4, num_attention_heads=2, decoder_dim=128,
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )
    image_processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=1024,
                                            max_pixels=65536)
    processor = without_video(Qwen3VLProcessor)(image_processor=image_processor, tokenizer=tokenizer)
    return {"text_encoder": text_encoder, "tokenizer": tokenizer, "processor": processor, "vae": vae,
            "audio_vae": audio_vae, "transformer": transformer, "scheduler": MiniMaxH3Scheduler(shift=12.0),
            "audio_scheduler": MiniMaxH3Scheduler(shift=3.0)}


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``MiniMaxH3ModularPipeline`` to ``path``, its index naming the published repo."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(**_components())
    pipe.save_pretrained(str(path), overwrite_modular_index=True)
    index_path = path / MODULAR_INDEX
    index = json.loads(index_path.read_text(encoding="utf-8"))
    for entry in index.values():
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict):
            entry[2]["pretrained_model_name_or_path"] = _PUBLISHED  # as a download's index says
    index_path.write_text(json.dumps(index, indent=2), encoding="utf-8")
    write_video_processor_config(path / "processor")  # as the real repo ships it
    return path
