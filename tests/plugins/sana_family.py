"""A Sana family plugin as an outside author writes it from plugin API 1's docs.

Inference only, ``FamilySpec`` sections, ``ENGINE_PLUGIN_API = 1``: its DC-AE compresses
32x with 1x1 patches, which its table says (``geometry``), and its pipeline's resolution
binning is turned off through ``engine_generate_kwargs`` for the sizes the engine fitted.
It must load unchanged under plugin API 2 and pass the contract kit.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.contract.hookspecs import hookimpl
from engine.contract.types import (
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LatentGeometry,
    LoraLayout,
    TrainingSpec,
)

ENGINE_PLUGIN_API = 1

SANA = FamilySpec(
    name="sana",
    label="Sana",
    architecture="dit",
    pipeline_class="SanaPipeline",
    pipeline_class_names=("SanaPipeline",),
    checkpoints=(
        Checkpoint("sana-1600m-1024", "Sana 1600M 1024px", "Efficient-Large-Model/Sana_1600M_1024px_diffusers",
                   default_steps=20, default_guidance=4.5, matches=("*sana_1600m*", "*sana-1600m*")),
    ),
    # The 1.6B linear DiT and Gemma-2 2B in bf16, the 32x DC-AE.
    sizes=ComponentSizes(transformer_gb=3.2, text_encoders_gb=5.2, vae_gb=0.63),
    geometry=LatentGeometry(spatial_compression=32, patch_size=1),
    side_multiple=32,
    compile_regions=("SanaTransformerBlock",),
    tiny_pipeline="tests.plugins.sana_family:build_tiny_pipeline",
    lora=LoraLayout(targets=("to_q", "to_k", "to_v")),
    training=TrainingSpec(dense_gb=3.2),
)


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(SANA)


@hookimpl
def engine_generate_kwargs(family: FamilySpec, pipeline: object, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The engine sized the request already: no binning onto Sana's trained aspect ratios, and
    no long system instruction before a prompt (the pipeline's default)."""
    if family.name != "sana":
        return None
    return {**kwargs, "use_resolution_binning": False, "complex_human_instruction": None}


def build_tiny_pipeline(path: Path) -> Path:
    """A tiny random-weight ``SanaPipeline`` (Gemma-2 and a DC-AE at toy widths)."""
    import torch
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from engine.testing.tiny_tokenizers import gemma_char_tokenizer

    torch.manual_seed(0)
    tokenizer = gemma_char_tokenizer()
    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
        sample_size=2, patch_size=1)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), downsample_block_type="conv",
        upsample_block_type="interpolate", scaling_factor=0.41407)
    text_encoder = Gemma2Model(Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=16))
    SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                 scheduler=FlowMatchEulerDiscreteScheduler()).save_pretrained(path)
    return path
