"""A PixArt-Sigma family plugin as an outside author writes it from plugin API 0's docs.

Inference only (no trainer: a family may leave training out), flat ``FamilySpec`` fields
of plugin API 0 (``lora_targets``, ``training_dense_gb``, ``quant_deny``), no declared
API. It must load unchanged, with the register's warnings, and pass the contract kit.
"""

from collections.abc import Callable
from pathlib import Path

from engine.contract.hookspecs import hookimpl
from engine.contract.types import Checkpoint, ComponentSizes, FamilySpec, QuantDeny

PIXART = FamilySpec(
    name="pixart-sigma",
    label="PixArt-Sigma",
    architecture="dit",
    pipeline_class="PixArtSigmaPipeline",
    pipeline_class_names=("PixArtSigmaPipeline",),
    checkpoints=(
        Checkpoint("pixart-sigma-xl-1024", "PixArt-Sigma XL 1024", "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
                   default_steps=20, default_guidance=4.5, matches=("*pixart-sigma*",)),
    ),
    # The 0.6B DiT in bf16, T5-XXL's encoder (bf16) and the SD VAE.
    sizes=ComponentSizes(transformer_gb=1.2, text_encoders_gb=9.5, vae_gb=0.17),
    compile_regions=("BasicTransformerBlock",),
    tiny_pipeline="tests.plugins.pixart_family:build_tiny_pipeline",
    # Plugin API 0's flat spellings, as its docs taught them.
    training_dense_gb=1.2,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    quant_deny={"inference": (QuantDeny("fp8", "not measured for PixArt-Sigma"),)},
)


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(PIXART)


def build_tiny_pipeline(path: Path) -> Path:
    """A tiny random-weight ``PixArtSigmaPipeline`` (T5 and the SD VAE at toy widths)."""
    import torch
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    from engine.testing.tiny_tokenizers import t5_unigram_tokenizer

    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        sample_size=32, num_layers=2, attention_head_dim=8, num_attention_heads=2, in_channels=4, out_channels=8,
        cross_attention_dim=16, caption_channels=32, patch_size=2, norm_type="ada_norm_single",
        use_additional_conditions=False)
    vae = AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=8)
    text_encoder = T5EncoderModel(T5Config(vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2))
    pipe = PixArtSigmaPipeline(tokenizer=t5_unigram_tokenizer(120), text_encoder=text_encoder, vae=vae,
                               transformer=transformer, scheduler=DPMSolverMultistepScheduler())
    pipe.save_pretrained(path)
    return path
