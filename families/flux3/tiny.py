"""Tiny random-weight FLUX.3 modular pipelines for fast, offline tests.

A ``diffusers.Flux3ModularPipeline`` of the family's real classes, saved as its repo is
(``modular_model_index.json`` and a folder per component): the ``Flux3Transformer2DModel`` (one
double- and one single-stream block), the FLUX.2 VAE (``AutoencoderKLFlux2``, 8x, its batch-norm
statistics), a ``Qwen3VLForConditionalGeneration`` of 33 narrow layers (the blocks stack hidden
states 4, 8, ..., 32) with its ``Qwen3VLProcessor``, the ``Flux3ImageProcessor``, and the
classifier-free guider (3.5). No prompt upsampler (a generative Qwen3.5 that rewrites the
prompt): the repo's optional step, left out where its component is (``PipelineLayout.optional_steps``).
:func:`build_tiny_distilled_pipeline` writes the step-distilled ``Flux3DistilledModularPipeline``.
"""

from __future__ import annotations

import pathlib

import torch
from diffusers import (
    AutoencoderKLFlux2,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    Flux3DistilledModularPipeline,
    Flux3ModularPipeline,
    Flux3Transformer2DModel,
)
from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
from transformers import Qwen2VLImageProcessor, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from engine.runtime.processors import without_video
from engine.testing.tiny_qwen3_vl import SPECIAL_TOKENS, qwen3_vl_config, write_video_processor_config
from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_RESOLUTION", "build_tiny_distilled_pipeline", "build_tiny_pipeline"]

TINY_RESOLUTION: int = 64
_SEED = 0
_TEXT_DIM = 16
_TAPS = 8  # hidden states 4, 8, ..., 32
_LATENT_CHANNELS = 8
_CORPUS = ["<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", "a red fox in the snow", "a lighthouse at dusk"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _components(guided: bool) -> dict[str, object]:
    tokenizer = qwen_chat_tokenizer(SPECIAL_TOKENS, _CORPUS, chat_template=_CHAT_TEMPLATE)
    torch.manual_seed(_SEED)
    text_encoder = Qwen3VLForConditionalGeneration(qwen3_vl_config(tokenizer, _TEXT_DIM, 4 * _TAPS + 1)).eval()
    torch.manual_seed(_SEED)
    transformer = Flux3Transformer2DModel(
        in_channels=_LATENT_CHANNELS * 4, cond_in_channels=_LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=_TEXT_DIM * _TAPS, timestep_channels=32,
        axes_dims_rope=(4, 4, 4, 4), flow_map=not guided,  # the distilled model is a flow map (from t to a target t)
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=_LATENT_CHANNELS,
                             norm_num_groups=4, sample_size=TINY_RESOLUTION)
    image_processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=1024,
                                            max_pixels=65536)
    processor = without_video(Qwen3VLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                chat_template=_CHAT_TEMPLATE)
    components: dict[str, object] = {
        "text_encoder": text_encoder, "tokenizer": processor, "image_processor": Flux3ImageProcessor(), "vae": vae,
        "transformer": transformer, "scheduler": FlowMatchEulerDiscreteScheduler(),
    }
    if guided:
        components["guider"] = ClassifierFreeGuidance(guidance_scale=3.5)
    return components


def _save(pipe: object, path: pathlib.Path, guided: bool) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    pipe.update_components(**_components(guided))  # type: ignore[attr-defined]
    pipe.save_pretrained(str(path), overwrite_modular_index=True)  # type: ignore[attr-defined]
    write_video_processor_config(path / "tokenizer")  # as a Qwen3-VL processor ships
    return path


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``Flux3ModularPipeline`` (50 steps, classifier-free guidance) to ``path``."""
    return _save(Flux3ModularPipeline(), pathlib.Path(path), guided=True)


def build_tiny_distilled_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``Flux3DistilledModularPipeline`` (16 steps, no guidance) to ``path``."""
    return _save(Flux3DistilledModularPipeline(), pathlib.Path(path), guided=False)
