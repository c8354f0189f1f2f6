"""Tiny random-weight Qwen-Image pipeline for fast, offline tests.

Builds a ``diffusers.QwenImagePipeline`` with the family's real component classes
(``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage``,
``Qwen2_5_VLForConditionalGeneration``, a byte-level BPE ``Qwen2Tokenizer`` and
``FlowMatchEulerDiscreteScheduler``) but shrunk to a few million parameters, so a
2-step 64x64 generate runs in well under a second on CPU.

Shape choices and why:

* Transformer: one MMDiT block, 4 heads x 128 = inner dim 512 (real: 60 blocks,
  24 x 128). 512 keeps the attention / MLP ``nn.Linear`` layers at >= 512 in and out
  features so int8 quantisation filters have something to quantise; the real
  ``axes_dims_rope=(16, 56, 56)`` still sums to the head dim of 128.
* VAE: real 16-channel latent space and real temporal/spatial downsampling
  (``temperal_downsample=[False, True, True]`` -> 8x spatial), but ``base_dim=16``
  and one res block per level. Latents are packed in 2x2 patches, so height and
  width must be multiples of 16.
* Text encoder: 2-layer Qwen2.5-VL with hidden size 32 (== transformer
  ``joint_attention_dim``), head dim 16, so the M-RoPE ``mrope_section`` must sum to
  ``head_dim / 2 = 8``. The vision tower is required by the class but never used.
* Tokenizer: built locally (no hub) by training a byte-level BPE with Qwen2's
  pre-tokenizer on the pipeline's prompt template, so that the system prefix
  tokenises to exactly ``prompt_template_encode_start_idx`` (34) tokens, like the
  real tokenizer; any other text still tokenises through the byte alphabet.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from engine.testing.tiny_tokenizers import qwen_chat_tokenizer

__all__ = ["TINY_GENERATE_KWARGS", "TINY_RESOLUTION", "build_tiny_edit_pipeline", "build_tiny_edit_plus_pipeline",
           "build_tiny_pipeline"]

#: Works for the tiny pipeline; any multiple of 16 (VAE 8x * 2x2 packing) does.
TINY_RESOLUTION: int = 64

#: Extra ``QwenImagePipeline.__call__`` kwargs. ``true_cfg_scale`` only matters when a
#: ``negative_prompt`` is passed; 1.0 keeps a single transformer pass per step.
#: ``max_sequence_length`` caps prompt tokens after the dropped template prefix.
TINY_GENERATE_KWARGS: dict[str, Any] = {"true_cfg_scale": 1.0, "max_sequence_length": 64}

_SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

_TOKENIZER_CORPUS: list[str] = [
    # QwenImagePipeline.prompt_template_encode, minus the special tokens.
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:\nuser\nassistant\n",
    "a photo of a cat and a dog, red blue green yellow, an astronaut riding a horse on the moon",
]

_CHAT_TEMPLATE: str = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT_HIDDEN: int = 32
_TEXT_HEADS: int = 2
_MROPE_SECTION: list[int] = [2, 3, 3]  # sums to (_TEXT_HIDDEN // _TEXT_HEADS) // 2


def _build_tokenizer() -> Qwen2Tokenizer:
    """The shared tiny byte-level BPE (:func:`engine.testing.tiny_tokenizers.qwen_chat_tokenizer`)
    with Qwen2.5-VL's vision tokens, the pipeline's prompt template as corpus, and a plain chat template."""
    return qwen_chat_tokenizer(_SPECIAL_TOKENS, _TOKENIZER_CORPUS, _CHAT_TEMPLATE)


def _build_text_encoder(tokenizer: Qwen2Tokenizer, layers: int = 2) -> Qwen2_5_VLForConditionalGeneration:
    head_dim = _TEXT_HIDDEN // _TEXT_HEADS
    assert sum(_MROPE_SECTION) * 2 == head_dim, "mrope_section must sum to head_dim / 2"
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": _TEXT_HIDDEN,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": _TEXT_HEADS,
            "num_key_value_heads": _TEXT_HEADS,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": list(_MROPE_SECTION),
            },
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": _TEXT_HIDDEN,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny random-weight ``QwenImagePipeline`` to ``path`` and return ``path``.

    Weights are deterministic (``torch.manual_seed(0)`` before each model).
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    QwenImagePipeline(**_components()).save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_edit_pipeline(path: pathlib.Path, *, plus: bool = False) -> pathlib.Path:
    """Write a tiny ``QwenImageEditPipeline`` (``plus``: the multi-image
    ``QwenImageEditPlusPipeline`` of Edit-2509/2511) to ``path``: the same weights as
    :func:`build_tiny_pipeline` (same seeds) and a real ``Qwen2VLProcessor``
    folder (the tiny tokenizer, a Qwen2-VL image processor capped at 112x112
    pixels, so the vision tower sees at most 16 merged patches; the real one
    allows 12.8 MP) with the video processor's config the real checkpoint ships.
    The processor is built without its video part, which needs torchvision: an
    edit never calls it, and the saved folder is the real layout either way."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    from engine.runtime.processors import without_video

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    parts = _components()
    limits = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
    processor = without_video(Qwen2VLProcessor)(
        image_processor=Qwen2VLImageProcessor(**limits), tokenizer=parts["tokenizer"]
    )
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipeline_class(**parts, processor=processor).save_pretrained(path, safe_serialization=True)
    (path / "processor" / "video_preprocessor_config.json").write_text(json.dumps({
        **limits, "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor",
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }, indent=2))
    return path


def build_tiny_edit_plus_pipeline(path: pathlib.Path) -> pathlib.Path:
    """:func:`build_tiny_edit_pipeline` with ``plus``: the Edit-2509/2511 checkpoints' own tiny pipeline."""
    return build_tiny_edit_pipeline(path, plus=True)


def _components() -> dict[str, Any]:
    """The tiny pipeline's parts, seeded."""
    tokenizer = _build_tokenizer()

    torch.manual_seed(0)
    text_encoder = _build_text_encoder(tokenizer)

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels * 2x2 packing
        out_channels=16,
        num_layers=2,  # First-Block-Cache needs a head and a tail block
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=_TEXT_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),
    )

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )

    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )

    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }
