"""Tiny random-weight FLUX.2 pipelines (klein and dev) for fast, offline tests.

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

FLUX.2 dev (:func:`build_tiny_dev_pipeline`) is a ``Flux2Pipeline`` with the same VAE and
transformer shapes but dev's guidance embedding, and a ``Mistral3ForConditionalGeneration`` text
encoder (a 31-layer Mistral of width 32 with a one-layer Pixtral vision tower: the pipeline
stacks layers 10, 20 and 30). Its tokenizer is the tokenizer part of dev's ``PixtralProcessor``
(a byte-level BPE with Mistral's control tokens and a chat template of the same shape):
transformers builds ``PixtralProcessor`` only with torchvision, which has no CPU build beside
this torch, and for a text prompt the processor's ``apply_chat_template`` is its tokenizer's,
so the ids and the embeddings are the ones the processor would give.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_RESOLUTION", "build_tiny_dev_pipeline", "build_tiny_pipeline"]

#: Any multiple of 16 works (VAE 8x, 2x2 patches).
TINY_RESOLUTION = 64
_TEXT_HIDDEN = 32
#: The pipeline's default ``text_encoder_out_layers`` is (9, 18, 27): the encoder needs 27+ layers.
_TEXT_LAYERS = 28
#: Flux2Pipeline's default ``text_encoder_out_layers`` is (10, 20, 30): Mistral needs 31 layers.
_DEV_TEXT_LAYERS = 31
#: Mistral-Small's control tokens (the first four are unk, bos, eos and pad) and its image tokens.
_MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                           "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
#: Mistral-Small-3's template shape: the system prompt in its tags, user turns in [INST], an
#: image part as [IMG] (content is a list of typed parts, as Flux2Pipeline's messages are).
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% for part in parts %}{{ part['text'] }}{% endfor %}"
    "[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{% for part in parts %}"
    "{% if part['type'] == 'image' %}[IMG]{% else %}{{ part['text'] }}{% endif %}{% endfor %}[/INST]"
    "{% else %}{% for part in parts %}{{ part['text'] }}{% endfor %}{{ eos_token }}{% endif %}{% endfor %}"
)


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
    pipeline = Flux2KleinPipeline(scheduler=_scheduler(), vae=_vae(), text_encoder=text_encoder, tokenizer=tokenizer,
                                  transformer=_transformer(guidance=False), is_distilled=distilled)
    return _save(pipeline, path, steps=4 if distilled else 8)


def mistral_chat_tokenizer() -> Any:
    """The tokenizer part of FLUX.2 dev's processor: a byte-level BPE trained on a few words
    (any text tokenises through the byte alphabet) with Mistral's control tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["a photo of a cat and a dog, red blue green yellow, an astronaut riding a horse on the moon"],
        trainers.BpeTrainer(vocab_size=2048, min_frequency=1, special_tokens=_MISTRAL_SPECIAL_TOKENS,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=131072, chat_template=_MISTRAL_CHAT_TEMPLATE)


def build_tiny_dev_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny FLUX.2 dev pipeline folder at ``path`` (guidance-distilled: the guidance
    embedding is on, as in dev's transformer). Deterministic weights."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = mistral_chat_tokenizer()
    torch.manual_seed(0)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=MistralConfig(
            vocab_size=len(tokenizer), hidden_size=_TEXT_HIDDEN, intermediate_size=64,
            num_hidden_layers=_DEV_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id),
        vision_config=PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, head_dim=16, image_size=64, patch_size=16),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
    )).eval()
    pipeline = Flux2Pipeline(scheduler=_scheduler(), vae=_vae(), text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=_transformer(guidance=True))
    return _save(pipeline, path, steps=4)


def _save(pipeline: Any, path: pathlib.Path, *, steps: int) -> pathlib.Path:
    """The pipeline saved at ``path``, with the engine's own defaults beside its
    model_index.json: the tiny size and a short run."""
    pipeline.save_pretrained(path, safe_serialization=True)
    (path / "diffusion_engine.json").write_text(json.dumps(
        {"width": TINY_RESOLUTION, "height": TINY_RESOLUTION, "steps": steps}))
    return path


def _transformer(*, guidance: bool) -> Flux2Transformer2DModel:
    """The tiny transformer: klein's is guided by CFG (no guidance embedding), dev's by the
    distilled guidance embedding."""
    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=16, joint_attention_dim=3 * _TEXT_HIDDEN, timestep_guidance_channels=256,
        mlp_ratio=3.0, axes_dims_rope=(8, 8, 8, 8), guidance_embeds=guidance,
    )


def _vae() -> AutoencoderKLFlux2:
    torch.manual_seed(0)
    return AutoencoderKLFlux2(
        block_out_channels=(32, 32, 64, 64), layers_per_block=1, latent_channels=32, norm_num_groups=32,
        sample_size=TINY_RESOLUTION,
    )


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
