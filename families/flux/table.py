"""FLUX.1: the family's data sheet. Pure data; no torch.

Figures: bf16 sizes of the 12B MMDiT (23.8 GB), CLIP-L + T5-XXL (9.8 GB) and
the 16-channel VAE (0.2 GB); sampling defaults per published checkpoint.
"""

from engine.contract.types import (
    ActivationFigures,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    FusionSite,
    LoraLayout,
    LoraTargetShape,
    MemoryProbe,
    PipelineLayout,
    QuantRules,
    Rendering,
    SdcppCompanion,
    SdcppSupport,
    SingleFileLayout,
    SpeedRules,
    TrainingDefaults,
    TrainingMemoryFigures,
    TrainingObjective,
    TrainingSpec,
)

FLUX = FamilySpec(
    name="flux",
    label="FLUX.1",
    aliases=("flux1", "flux.1"),
    architecture="dit",
    pipeline_class="FluxPipeline",
    pipeline_class_names=("FluxPipeline", "FluxImg2ImgPipeline", "FluxKontextPipeline"),
    checkpoints=(
        Checkpoint(
            name="flux.1-dev",
            label="FLUX.1-dev",
            repo="black-forest-labs/FLUX.1-dev",
            default_steps=28,
            default_guidance=3.5,
            attention_heads=24,  # 3072 wide, heads of 128
            # MagCache's ratios for FLUX.1-dev, as diffusers ships them (28 steps, interpolated).
            mag_ratios="diffusers.hooks.mag_cache:FLUX_MAG_RATIOS",
            matches=("*flux.1-dev*", "*flux1-dev*", "*flux-dev*"),
        ),
        Checkpoint(
            name="flux.1-schnell",
            label="FLUX.1-schnell",
            repo="black-forest-labs/FLUX.1-schnell",
            default_steps=4,
            default_guidance=0.0,
            attention_heads=24,  # 3072 wide, heads of 128
            matches=("*flux.1-schnell*", "*flux1-schnell*", "*flux-schnell*"),
        ),
        Checkpoint(
            name="flux.1-krea-dev",
            label="FLUX.1-Krea-dev",
            repo="black-forest-labs/FLUX.1-Krea-dev",
            default_steps=28,
            default_guidance=4.5,
            attention_heads=24,  # 3072 wide, heads of 128
            matches=("*flux.1-krea-dev*", "*flux1-krea*", "*flux-krea*"),
        ),
        Checkpoint(
            name="flux.1-kontext-dev",
            label="FLUX.1-Kontext-dev",
            repo="black-forest-labs/FLUX.1-Kontext-dev",
            default_steps=28,
            default_guidance=2.5,
            attention_heads=24,  # 3072 wide, heads of 128
            matches=("*flux.1-kontext-dev*", "*flux1-kontext*", "*flux-kontext*"),
            pipeline_class="FluxKontextPipeline",
            workflows=(("edit", "FluxKontextPipeline"), ("inpaint", "FluxKontextInpaintPipeline")),
        ),
    ),
    sizes=ComponentSizes(transformer_gb=23.8, text_encoders_gb=9.8, vae_gb=0.2),
    runtime_module="families.flux.runtime",
    tiny_pipeline="families.flux.tiny:build_tiny_pipeline",
    quantisation=QuantRules(
        prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*int4*", "*nf4*"),
        default_dense_base="black-forest-labs/FLUX.1-dev",
        # Measured with bench/planner_accuracy.py --factors (full-size config, the
        # engine's module filter): int8 keeps modulation and embeddings in bf16.
        factors={"int8": 0.64},
        # int8 keeps the timestep / guidance / pooled-text embedders dense (M = batch).
        int8_dense_modules=("time_text_embed",),
    ),
    single_file=SingleFileLayout(
        markers=("single_transformer_blocks.", "double_blocks."),
    ),
    # stable-diffusion.cpp on a CPU machine: the transformer file people download (GGUF or an
    # original-layout .safetensors) with ae.safetensors and the text encoders beside it, as
    # its docs lay them out. Without T5-XXL it encodes an all-zero T5 context.
    sdcpp=SdcppSupport(
        kinds=("single_file", "gguf"),
        companions=(
            SdcppCompanion("vae_path", "the autoencoder", ("ae.safetensors", "ae.sft", "*flux*vae*.safetensors")),
            SdcppCompanion("clip_l_path", "CLIP-L", ("clip_l*.safetensors", "clip_l*.gguf")),
            SdcppCompanion(
                "t5xxl_path", "T5-XXL", ("t5xxl*.safetensors", "t5xxl*.gguf", "t5-v1_1-xxl*.gguf"),
                required=False, missing="prompts are encoded by CLIP-L alone (an all-zero T5 context)",
            ),
        ),
        workflows=("txt2img", "img2img"),
        guidance_argument="guidance",
        tiny_files="families.flux.sdcpp_files:write_tiny",
    ),
    lora=LoraLayout(
        targets=(
            "to_q",
            "to_k",
            "to_v",
            "to_out.0",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_add_out",
        ),
        # LoRA keys: diffusers (single_transformer_blocks) and BFL / kohya /
        # ComfyUI (double_blocks, single_blocks) spellings.
        key_markers=("single_transformer_blocks", "double_blocks", "single_blocks"),
        # The kohya / ComfyUI layout is BFL's: q, k, v fused into one qkv Linear
        # per stream; a single block's linear1 is q, k, v and the MLP input fused.
        kohya_map=(
            ("double_blocks_{i}_img_attn_qkv", (
                "transformer_blocks.{i}.attn.to_q",
                "transformer_blocks.{i}.attn.to_k",
                "transformer_blocks.{i}.attn.to_v",
            )),
            ("double_blocks_{i}_img_attn_proj", ("transformer_blocks.{i}.attn.to_out.0",)),
            ("double_blocks_{i}_txt_attn_qkv", (
                "transformer_blocks.{i}.attn.add_q_proj",
                "transformer_blocks.{i}.attn.add_k_proj",
                "transformer_blocks.{i}.attn.add_v_proj",
            )),
            ("double_blocks_{i}_txt_attn_proj", ("transformer_blocks.{i}.attn.to_add_out",)),
            ("double_blocks_{i}_img_mlp_0", ("transformer_blocks.{i}.ff.net.0.proj",)),
            ("double_blocks_{i}_img_mlp_2", ("transformer_blocks.{i}.ff.net.2",)),
            ("double_blocks_{i}_txt_mlp_0", ("transformer_blocks.{i}.ff_context.net.0.proj",)),
            ("double_blocks_{i}_txt_mlp_2", ("transformer_blocks.{i}.ff_context.net.2",)),
            ("double_blocks_{i}_img_mod_lin", ("transformer_blocks.{i}.norm1.linear",)),
            ("double_blocks_{i}_txt_mod_lin", ("transformer_blocks.{i}.norm1_context.linear",)),
            ("single_blocks_{i}_linear1", (
                "single_transformer_blocks.{i}.attn.to_q",
                "single_transformer_blocks.{i}.attn.to_k",
                "single_transformer_blocks.{i}.attn.to_v",
                "single_transformer_blocks.{i}.proj_mlp",
            )),
            ("single_blocks_{i}_linear2", ("single_transformer_blocks.{i}.proj_out",)),
            ("single_blocks_{i}_modulation_lin", ("single_transformer_blocks.{i}.norm.linear",)),
            ("img_in", ("x_embedder",)),
            ("txt_in", ("context_embedder",)),
        ),
    ),
    training=TrainingSpec(
        # How engine.testing.memory_figures builds the denoiser (real widths, reduced depths).
        probe=MemoryProbe(
            model_class="FluxTransformer2DModel",
            blocks=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
            # FluxPipeline pads T5 to max_sequence_length; the engine trains at its default.
            text_tokens=512,
            text_dim="joint_attention_dim",
            pooled_dim=768,
            full={"guidance_embeds": True},
            derive={"num_layers": 1, "num_single_layers": 2},
            deeper={"num_layers": 2, "num_single_layers": 4},
            check={"num_layers": 3, "num_single_layers": 6},
            narrow={"num_layers": 1, "num_single_layers": 2, "num_attention_heads": 2},
        ),
        dense_gb=23.8,
        base_precision_applies=True,
        requires_bf16=True,
        # FLUX.1-dev's scheduler shifts dynamically at inference; its LoRA recipes
        # train with logit-normal sampling unshifted, 10 warmup steps, LR 1e-4.
        defaults=TrainingDefaults(
            learning_rate=1e-4, warmup_steps=10, flow_shift=1.0,
            source="FLUX.1 LoRA recipes: logit-normal timesteps, no shift, short warmup",
        ),
        objective=TrainingObjective(
            prediction="flow_matching",
            timestep_sampling="logit_normal",
        ),
        # Measured by `bench/memory_accuracy.py --derive` (bf16 LoRA step, rank 16,
        # real widths, 1 + 2 and 2 + 4 double + single blocks: a "block" is the
        # 1:2 average of the 19 double and 38 single). Elements per token; outside
        # includes the backward's transient at the step's peak. Text: T5 padded
        # to 512.
        memory=TrainingMemoryFigures(
            activations=ActivationFigures(
                block_per_image_token=61693.3,
                block_per_text_token=61693.3,
                checkpointed_block_per_image_token=3072.0,
                checkpointed_block_per_text_token=3072.0,
                outside_per_image_token=40670.0,
                outside_per_text_token=40350.0,
                blocks=57,
                text_tokens=512,
            ),
            lora_targets=(
                LoraTargetShape("add_k_proj", 3072, 3072, 19),
                LoraTargetShape("add_q_proj", 3072, 3072, 19),
                LoraTargetShape("add_v_proj", 3072, 3072, 19),
                LoraTargetShape("to_add_out", 3072, 3072, 19),
                LoraTargetShape("to_k", 3072, 3072, 57),
                LoraTargetShape("to_out.0", 3072, 3072, 19),
                LoraTargetShape("to_q", 3072, 3072, 57),
                LoraTargetShape("to_v", 3072, 3072, 57),
            ),
        ),
    ),
    pipeline=PipelineLayout(
        workflows=(
            ("img2img", "FluxImg2ImgPipeline"),
            ("inpaint", "FluxInpaintPipeline"),
            ("controlnet", "FluxControlNetPipeline"),
        ),
        controlnet_classes=("FluxControlNetModel",),
        # FluxPipeline opens a cache context around its transformer calls; the
        # Kontext and img2img pipelines do not (First-Block-Cache would fail there).
        cache_context_pipelines=("FluxPipeline",),
    ),
    speed=SpeedRules(
        compile_regions=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
        context_parallel=True,  # FluxTransformer2DModel declares diffusers' context-parallel plan
        eager_fusions=(
            FusionSite("FluxTransformerBlock", 6), FusionSite("FluxSingleTransformerBlock", 1),
            FusionSite("AdaLayerNormZero", 1), FusionSite("AdaLayerNormZeroSingle", 1),
        ),
    ),
    rendering=Rendering(
        # The VAE decoder's peak per output pixel: its full-resolution up block
        # (128 channels) holds about six tensors of that width at once (input,
        # fp32 group-norm upcast, conv output), 6 x 128 elements. Derived from
        # the architecture, not yet benchmarked (bench/ has no VAE probe yet).
        vae_decode_per_pixel=768.0,
    ),
)
