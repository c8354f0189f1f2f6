"""Tiny random-weight Ideogram 4 pipeline for fast, offline tests.

A ``diffusers.Ideogram4Pipeline`` of the family's real classes: two ``Ideogram4Transformer2DModel``
(the conditional and the unconditional one, two blocks each, seeded apart as the real pair are
trained apart), the FLUX.2 VAE (``AutoencoderKLFlux2``, its batch-norm statistics read at decode)
and a ``Qwen3VLModel`` text encoder of 36 narrow layers: the pipeline taps thirteen fixed layers
of the real Qwen3-VL-8B's 36 (``QWEN3_VL_ACTIVATION_LAYERS``), so the tiny one needs them all. Its
tokenizer is a tiny byte-level BPE with Qwen3-VL's chat template for list-of-parts messages.
"""

from __future__ import annotations

import pathlib

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline, Ideogram4Transformer2DModel
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS
from transformers import Qwen3VLModel

from engine.testing.tiny_qwen3_vl import SPECIAL_TOKENS, qwen3_vl_config
from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_RESOLUTION", "build_tiny_pipeline", "transformer"]

TINY_RESOLUTION: int = 64
_SEED = 0
_TEXT_DIM = 16
_LATENT_CHANNELS = 8
_CORPUS = ["<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", "a red fox in the snow", "a lighthouse at dusk"]
#: Qwen3-VL's chat template, as far as the pipeline reads it (one user message of text parts).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def transformer(seed: int = _SEED) -> Ideogram4Transformer2DModel:
    """One tiny transformer (the conditional one at the default seed)."""
    torch.manual_seed(seed)
    return Ideogram4Transformer2DModel(
        in_channels=_LATENT_CHANNELS * 4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        intermediate_size=64, adaln_dim=16, llm_features_dim=_TEXT_DIM * len(QWEN3_VL_ACTIVATION_LAYERS),
        mrope_section=(4, 2, 2),
    )


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``Ideogram4Pipeline`` to ``path``."""
    path = pathlib.Path(path)
    tokenizer = qwen_chat_tokenizer(SPECIAL_TOKENS, _CORPUS, chat_template=_CHAT_TEMPLATE)
    torch.manual_seed(_SEED)
    text_encoder = Qwen3VLModel(qwen3_vl_config(tokenizer, _TEXT_DIM, max(QWEN3_VL_ACTIVATION_LAYERS) + 1)).eval()
    torch.manual_seed(_SEED)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=_LATENT_CHANNELS,
                             norm_num_groups=4, sample_size=TINY_RESOLUTION)
    Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                      tokenizer=tokenizer, transformer=transformer(), unconditional_transformer=transformer(_SEED + 1),
                      ).save_pretrained(path)
    return path


def write_fp8_fused_layout(dense: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Rewrite the tiny pipeline at ``dense`` as Ideogram's fp8 repo lays its transformers out:
    each block's Linears float8_e4m3fn with a per-output-channel ``weight_scale`` (fp32), q, k
    and v fused into ``attention.qkv`` and the output projection named ``attention.o``; the
    rest as diffusers stores it. ``dense`` is first re-saved with the weights fp8 can hold
    exactly (each rounded through its scale), so the two folders hold the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.testing.checkpoints import fp8_rounded

    out = pathlib.Path(out)
    shutil.copytree(dense, out)
    for name in ("transformer", "unconditional_transformer"):
        file = next((pathlib.Path(dense) / name).glob("*.safetensors"))
        state = load_file(str(file))
        held: dict[str, torch.Tensor] = {}
        stored: dict[str, torch.Tensor] = {}
        for key, weight in state.items():
            if not (key.startswith("layers.") and key.endswith(".weight") and weight.ndim == 2):
                held[key] = stored[key] = weight
                continue
            codes, scale, held[key] = fp8_rounded(weight, per_row=True)
            stored[key], stored[key.removesuffix(".weight") + ".weight_scale"] = codes, scale
        for i in sorted({int(key.split(".")[1]) for key in stored if ".attention.to_q." in key}):
            block = f"layers.{i}.attention"
            parts = [(stored.pop(f"{block}.to_{p}.weight"), stored.pop(f"{block}.to_{p}.weight_scale")) for p in "qkv"]
            stored[f"{block}.qkv.weight"] = torch.cat([w for w, _ in parts])
            stored[f"{block}.qkv.weight_scale"] = torch.cat([s for _, s in parts])
            for suffix in ("weight", "weight_scale"):
                stored[f"{block}.o.{suffix}"] = stored.pop(f"{block}.to_out.0.{suffix}")
        save_file(held, str(file))
        save_file(stored, str(out / name / file.name))
    return out
