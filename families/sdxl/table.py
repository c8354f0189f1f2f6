"""Stable Diffusion XL: the family's data sheet. Pure data; no torch.

Figures: bf16 sizes of the 2.6B-parameter UNet (5.1 GB), CLIP-L +
OpenCLIP-bigG (1.6 GB) and the VAE (0.2 GB). The UNet trainer runs in fp16
mixed precision where bf16 is missing, so ``base_precision`` does not apply.
"""

from engine.contract.schemes import ENCODER_SCHEMES
from engine.contract.types import (
    ActivationFigures,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LoraLayout,
    LoraTargetShape,
    MemoryProbe,
    OptimizationDeny,
    PipelineLayout,
    QuantDeny,
    QuantRules,
    Rendering,
    SingleFileLayout,
    SpeedRules,
    TrainingDefaults,
    TrainingMemoryFigures,
    TrainingObjective,
    TrainingSpec,
)

#: SDXL base 1.0's UNet (2.6B parameters), where diffusers' class defaults are not it:
#: what the memory tool and the benchmarks build random-weight full-size UNets from.
SDXL_UNET: dict[str, object] = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time",
    addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
)

SDXL = FamilySpec(
    name="sdxl",
    label="Stable Diffusion XL",
    aliases=("sd-xl", "stable-diffusion-xl"),
    architecture="unet",
    pipeline_class="StableDiffusionXLPipeline",
    pipeline_class_names=(
        "StableDiffusionXLPipeline",
        "StableDiffusionXLImg2ImgPipeline",
        "StableDiffusionXLInpaintPipeline",
    ),
    checkpoints=(
        Checkpoint(
            name="sdxl-base-1.0",
            label="SDXL base 1.0",
            repo="stabilityai/stable-diffusion-xl-base-1.0",
            default_steps=30,
            default_guidance=7.0,
            matches=("*stable-diffusion-xl*", "*sdxl*", "*sd_xl*"),
        ),
        Checkpoint(
            name="sdxl-turbo",
            label="SDXL-Turbo",
            repo="stabilityai/sdxl-turbo",
            default_steps=3,
            default_guidance=0.0,
            matches=("*sdxl-turbo*", "*sdxl_turbo*", "*sd_xl_turbo*"),
        ),
    ),
    sizes=ComponentSizes(transformer_gb=5.1, text_encoders_gb=1.6, vae_gb=0.2),
    runtime_module="families.sdxl.runtime",
    tiny_pipeline="families.sdxl.tiny:build_tiny_pipeline",
    quantisation=QuantRules(
        prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*int4*", "*nf4*"),
        default_dense_base="stabilityai/stable-diffusion-xl-base-1.0",
        # Measured with bench/planner_accuracy.py --factors (full-size config, the
        # engine's module filter): the UNet's convolutions stay dense in every scheme.
        factors={"int8": 0.57, "fp8": 0.57, "mxfp8": 0.58, "nvfp4": 0.38, "nf4": 0.38},
        # int8 keeps the time and added-condition embeddings and each resnet's
        # timestep projection dense (M = batch: under CUDA int8's 16 rows).
        int8_dense_modules=("time_embedding", "add_embedding", "time_emb_proj"),
        # CLIP-L + OpenCLIP-bigG are 1.6 GB together: quantising them saves
        # under 1 GB, and the UNet reads their penultimate hidden states and
        # pooled projection directly, which no A/B here has checked quantised.
        text_encoder_deny=tuple(
            QuantDeny(scheme, "SDXL's CLIP encoders are 1.6 GB: quantising saves under 1 GB, "
                      "and their penultimate states feed the UNet unchecked by any A/B")
            for scheme in ENCODER_SCHEMES if scheme != "none"
        ),
    ),
    single_file=SingleFileLayout(
        # The checkpoints people download (base, fine-tunes) are one .safetensors
        # holding UNet, both text encoders and the VAE in the original layout.
        whole_pipeline=True,
        parts=(
            ("model.diffusion_model.", "denoiser"),
            ("conditioner.embedders.", "text_encoders"),
            ("first_stage_model.", "vae"),
        ),
        gguf_refused_reason=(
            "diffusers loads GGUF weights only for transformer models; an SDXL UNet in GGUF "
            "cannot be loaded (use the .safetensors checkpoint, or --quant int8 on it)"
        ),
        markers=("add_embedding.linear_1.", "conditioner.embedders.1."),
    ),
    lora=LoraLayout(
        targets=("to_q", "to_k", "to_v", "to_out.0"),
        # LoRA keys: UNet blocks (diffusers and SGM spellings) and the second
        # text encoder.
        key_markers=(
            "down_blocks", "up_blocks", "mid_block", "input_blocks", "output_blocks",
            "middle_block", "lora_te1_", "lora_te2_", "text_encoder_2",
        ),
    ),
    training=TrainingSpec(
        # How engine.testing.memory_figures builds the UNet: the reduced one keeps the
        # real mix of 640- and 1280-channel transformer layers (1:6), (1, 1, 5) holding
        # 35 of the real 70 BasicTransformerBlocks; no smaller second depth keeps the
        # mix, so blocks are read by hooks (no ``deeper``) and the check runs full size.
        probe=MemoryProbe(
            model_class="UNet2DConditionModel",
            blocks=("BasicTransformerBlock",),
            text_tokens=77,  # CLIP-L + bigG, 77 positions
            text_dim="cross_attention_dim",
            pooled_dim=1280,
            latent_channels=4,
            full=SDXL_UNET,
            derive={"transformer_layers_per_block": (1, 1, 5)},
            deeper=None,
            narrow={"transformer_layers_per_block": (1, 1, 2), "block_out_channels": (64, 128, 256),
                    "attention_head_dim": (1, 2, 4)},
        ),
        dense_gb=5.1,
        base_precision_applies=False,
        requires_bf16=False,
        # Epsilon prediction: no flow shift; the common SDXL LoRA recipe.
        defaults=TrainingDefaults(
            learning_rate=1e-4, warmup_steps=0, source="SDXL LoRA recipes: LR 1e-4, no warmup",
        ),
        objective=TrainingObjective(
            prediction="epsilon",
            timestep_sampling="uniform",
        ),
        # Measured by `bench/memory_accuracy.py --derive` (bf16 LoRA step, rank 16,
        # real channels, transformer_layers_per_block (1, 1, 5): 35 of the 70
        # BasicTransformerBlocks in the real 640:1280-channel mix). An image token
        # is a 16x16-pixel patch; the resnets, convolutions and the backward's
        # transient at the peak are outside. Under checkpointing diffusers also
        # recomputes the resnets, so the outside then has its own figure. Text: 77 (CLIP).
        memory=TrainingMemoryFigures(
            activations=ActivationFigures(
                block_per_image_token=12162.1,
                block_per_text_token=10633.1,
                checkpointed_block_per_image_token=365.7,
                checkpointed_block_per_text_token=0.0,
                outside_per_image_token=95728.0,
                outside_per_text_token=0.0,
                blocks=70,
                text_tokens=77,
                checkpointed_outside_per_image_token=33259.9,
                checkpointed_outside_per_text_token=0.0,
            ),
            lora_targets=(
                LoraTargetShape("to_k", 640, 640, 10),
                LoraTargetShape("to_k", 1280, 1280, 60),
                LoraTargetShape("to_k", 2048, 640, 10),
                LoraTargetShape("to_k", 2048, 1280, 60),
                LoraTargetShape("to_out.0", 640, 640, 20),
                LoraTargetShape("to_out.0", 1280, 1280, 120),
                LoraTargetShape("to_q", 640, 640, 20),
                LoraTargetShape("to_q", 1280, 1280, 120),
                LoraTargetShape("to_v", 640, 640, 10),
                LoraTargetShape("to_v", 1280, 1280, 60),
                LoraTargetShape("to_v", 2048, 640, 10),
                LoraTargetShape("to_v", 2048, 1280, 60),
            ),
        ),
    ),
    pipeline=PipelineLayout(
        workflows=(
            ("img2img", "StableDiffusionXLImg2ImgPipeline"),
            ("inpaint", "StableDiffusionXLInpaintPipeline"),
            ("controlnet", "StableDiffusionXLControlNetPipeline"),
        ),
        controlnet_classes=("ControlNetModel",),
        denoiser="unet",
        denoiser_label="UNet",
        cache_context_pipelines=(),
    ),
    rendering=Rendering(
        # VAE stride 8; the UNet pads odd latent sides itself (forward_upsample_size).
        side_multiple=8,
        # The VAE decoder's peak per output pixel: its full-resolution up block
        # (128 channels) holds about six tensors of that width at once (input,
        # fp32 group-norm upcast, conv output), 6 x 128 elements. Derived from
        # the architecture, not yet benchmarked (bench/ has no VAE probe yet).
        vae_decode_per_pixel=768.0,
    ),
    speed=SpeedRules(
        compile_regions=("BasicTransformerBlock",),
        optimization_deny=(
            OptimizationDeny(
                "step_cache",
                "First-Block-Cache hooks transformer blocks; diffusers' SDXL UNet has none it caches",
            ),
        ),
    ),
)
