"""Tiny random-weight HiDream-I1 pipeline for fast, offline tests.

A ``diffusers.HiDreamImagePipeline`` of the family's real classes: the mixture-of-experts
``HiDreamImageTransformer2DModel`` (one double- and one single-stream block, four routed
experts, two active), an 8x ``AutoencoderKL``, and its four encoder/tokenizer pairs: two
``CLIPTextModelWithProjection`` (CLIP-L and CLIP-G: their pooled projections condition it), a
``T5EncoderModel`` and a ``LlamaForCausalLM`` (two layers: the transformer reads both hidden
states), each narrow, with tokenizers built with ``tokenizers``.

:func:`write_repo_layout` writes it as HiDream's repos are published: ``model_index.json``
naming ``text_encoder_4`` and ``tokenizer_4`` with neither folder shipped (Llama-3.1 is gated,
so the repo leaves it to the user), and :func:`write_llama` the encoder on its own, as its
source repo holds it.
"""

from __future__ import annotations

import pathlib
import shutil

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM

from engine.testing.tiny_tokenizers import qwen_chat_tokenizer
from families.flux.tiny import _clip_tokenizer, _t5_text_encoder, _t5_tokenizer

__all__ = ["BORROWED", "TINY_RESOLUTION", "build_tiny_pipeline", "write_llama", "write_repo_layout"]

TINY_RESOLUTION: int = 64
_SEED = 0
_CLIP_DIM = 32
_LLAMA_DIM = 16
#: The components HiDream's repos name without shipping.
BORROWED = ("text_encoder_4", "tokenizer_4")


def _clip(seed: int, tokenizer: object) -> CLIPTextModelWithProjection:
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=_CLIP_DIM, intermediate_size=64, num_hidden_layers=2,  # type: ignore[arg-type]
        num_attention_heads=4, max_position_embeddings=218, projection_dim=_CLIP_DIM, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )).eval()


def _llama() -> tuple[LlamaForCausalLM, object]:
    tokenizer = qwen_chat_tokenizer(["<|eot_id|>", "<|begin_of_text|>"], ["a red fox in the snow", "a lighthouse"])
    tokenizer.eos_token = "<|eot_id|>"
    torch.manual_seed(_SEED)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=_LLAMA_DIM, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|eot_id|>"),
    )).eval()
    return model, tokenizer


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``HiDreamImagePipeline`` (all four encoders in it) to ``path``."""
    path = pathlib.Path(path)
    clip = _clip_tokenizer()
    t5 = _t5_tokenizer()
    llama, llama_tokenizer = _llama()
    torch.manual_seed(_SEED)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_channels=[32, _LLAMA_DIM], text_emb_dim=2 * _CLIP_DIM, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1),
    ).eval()
    torch.manual_seed(_SEED)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                        layers_per_block=1, latent_channels=4, norm_num_groups=4, scaling_factor=0.3611,
                        shift_factor=0.1159)
    HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=_clip(_SEED, clip), tokenizer=clip, text_encoder_2=_clip(_SEED + 1, clip), tokenizer_2=clip,
        text_encoder_3=_t5_text_encoder(t5), tokenizer_3=t5, text_encoder_4=llama, tokenizer_4=llama_tokenizer,
        transformer=transformer,
    ).save_pretrained(path)
    return path


def write_repo_layout(full: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The tiny pipeline at ``full`` as HiDream's repos ship: every folder but the Llama pair's,
    which its ``model_index.json`` still names."""
    out = pathlib.Path(out)
    shutil.copytree(full, out, ignore=lambda folder, names: [n for n in names if n in BORROWED]
                    if pathlib.Path(folder) == pathlib.Path(full) else [])
    return out


def write_llama(full: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The tiny Llama as its own repo holds it: the model and its tokenizer in one folder."""
    out = pathlib.Path(out)
    shutil.copytree(pathlib.Path(full) / "text_encoder_4", out)
    for file in (pathlib.Path(full) / "tokenizer_4").iterdir():
        shutil.copy(file, out / file.name)
    return out
