"""Tiny random-weight FLUX.2 klein pipeline for fast, offline tests.

Builds a ``diffusers.Flux2KleinPipeline`` from the family's real component classes
(``Flux2Transformer2DModel``, ``AutoencoderKLFlux2``, a ``transformers.Qwen3ForCausalLM``
text encoder with a byte-level BPE ``Qwen2Tokenizer`` and Qwen3's chat template, and the
flow-matching scheduler) shrunk to a few million parameters.

Shape choices and why:

* Transformer: 16 heads of 32 (inner width 512, so the attention and feed-forward Linears
  have 512+ features and the quantisation filters have something to quantise), one double
  and one single block (real klein 4B: 5 and 20, width 3072). ``axes_dims_rope`` sums to the
  head dim. ``in_channels=128``: the 32-channel latents patchified 2x2, as the pipeline packs
  them. No guidance embedding: klein is guided by CFG (its base) or distilled to none.
* Text encoder: a 28-layer ``Qwen3ForCausalLM`` of width 32: the pipeline stacks the hidden
  states of layers 9, 18 and 27 (``text_encoder_out_layers``), so the transformer's
  ``joint_attention_dim`` is 3 x 32 = 96.
* VAE: ``AutoencoderKLFlux2`` with 32 latent channels and four levels (8x), narrow and one
  layer per block; with the 2x2 patchify one token covers 16x16 pixels, so sides are
  multiples of 16.
"""

from __future__ import annotations

import json
import pathlib

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_RESOLUTION", "build_tiny_pipeline"]

#: Any multiple of 16 works (VAE 8x, 2x2 patches).
TINY_RESOLUTION = 64
_TEXT_HIDDEN = 32
#: The pipeline's default ``text_encoder_out_layers`` is (9, 18, 27): the encoder needs 27+ layers.
_TEXT_LAYERS = 28


def build_tiny_pipeline(path: pathlib.Path, *, distilled: bool = True) -> pathlib.Path:
    """Write a tiny klein pipeline folder at ``path`` (``distilled``: the 4-step model's
    config, guidance off; False: its undistilled base). Deterministic weights."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_chat_tokenizer()
    torch.manual_seed(0)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=_TEXT_HIDDEN, intermediate_size=64,
        num_hidden_layers=_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )).eval()
    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=16, joint_attention_dim=3 * _TEXT_HIDDEN, timestep_guidance_channels=256,
        mlp_ratio=3.0, axes_dims_rope=(8, 8, 8, 8), guidance_embeds=False,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        block_out_channels=(32, 32, 64, 64), layers_per_block=1, latent_channels=32, norm_num_groups=32,
        sample_size=TINY_RESOLUTION,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
    pipeline = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                  transformer=transformer, is_distilled=distilled)
    pipeline.save_pretrained(path, safe_serialization=True)
    # The engine's own defaults beside model_index.json: the tiny size and a short run.
    (path / "diffusion_engine.json").write_text(json.dumps(
        {"width": TINY_RESOLUTION, "height": TINY_RESOLUTION, "steps": 4 if distilled else 8}))
    return path
