"""A Lumina-Image 2.0 family plugin as an outside author writes it from plugin API 1's docs.

Inference only, ``FamilySpec`` sections, ``ENGINE_PLUGIN_API = 1``, modules imported from
``engine.contract``. It must load unchanged under plugin API 2 and pass the contract kit.
"""

from collections.abc import Callable
from pathlib import Path

from engine.contract.hookspecs import hookimpl
from engine.contract.types import Checkpoint, ComponentSizes, FamilySpec, LoraLayout, TrainingSpec

ENGINE_PLUGIN_API = 1

LUMINA2 = FamilySpec(
    name="lumina2",
    label="Lumina-Image 2.0",
    architecture="dit",
    pipeline_class="Lumina2Pipeline",
    pipeline_class_names=("Lumina2Pipeline",),
    checkpoints=(
        Checkpoint("lumina-image-2.0", "Lumina-Image 2.0", "Alpha-VLLM/Lumina-Image-2.0",
                   default_steps=50, default_guidance=4.0, matches=("*lumina-image-2*",)),
    ),
    # The 2.6B DiT and Gemma-2 2B in bf16, FLUX.1's 16-channel VAE.
    sizes=ComponentSizes(transformer_gb=5.2, text_encoders_gb=5.2, vae_gb=0.17),
    compile_regions=("Lumina2TransformerBlock",),
    tiny_pipeline="tests.plugins.lumina_family:build_tiny_pipeline",
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0")),
    training=TrainingSpec(dense_gb=5.2),
)


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(LUMINA2)


def build_tiny_pipeline(path: Path) -> Path:
    """A tiny random-weight ``Lumina2Pipeline`` (Gemma-2 and an 8x VAE at toy widths)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from engine.testing.tiny_tokenizers import gemma_char_tokenizer

    torch.manual_seed(0)
    tokenizer = gemma_char_tokenizer()
    transformer = Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=2, multiple_of=16, cap_feat_dim=32, axes_dim_rope=(4, 6, 6),
        axes_lens=(300, 64, 64))
    vae = AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=8,
                        shift_factor=0.1159, scaling_factor=0.3611)
    text_encoder = Gemma2Model(Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=16))
    Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                    text_encoder=text_encoder, tokenizer=tokenizer).save_pretrained(path)
    return path
