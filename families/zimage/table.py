"""Z-Image: the family's data sheet. Pure data; no torch.

Figures: bf16 sizes of the 6B single-stream DiT (12.3 GB), the Qwen3-4B text
encoder (8.0 GB) and the 16-channel VAE (0.2 GB).
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
    OptimizationDeny,
    PipelineLayout,
    PrecisionRules,
    QuantRules,
    Rendering,
    SingleFileLayout,
    SpeedRules,
    TrainingDefaults,
    TrainingMemoryFigures,
    TrainingObjective,
    TrainingSpec,
)

ZIMAGE = FamilySpec(
    name="zimage",
    label="Z-Image",
    aliases=("z-image", "z_image"),
    architecture="dit",
    pipeline_class="ZImagePipeline",
    pipeline_class_names=("ZImagePipeline", "ZImageImg2ImgPipeline"),
    checkpoints=(
        Checkpoint(
            name="z-image-turbo",
            label="Z-Image-Turbo",
            repo="Tongyi-MAI/Z-Image-Turbo",
            default_steps=9,
            default_guidance=0.0,
            matches=("*z-image-turbo*", "*z_image_turbo*", "*zimage-turbo*"),
        ),
        Checkpoint(
            name="z-image",
            label="Z-Image",
            repo="Tongyi-MAI/Z-Image",
            default_steps=20,
            default_guidance=4.0,
            matches=("*z-image*", "*z_image*", "*zimage*"),
        ),
    ),
    sizes=ComponentSizes(transformer_gb=12.3, text_encoders_gb=8.0, vae_gb=0.2),
    runtime_module="families.zimage.runtime",
    tiny_pipeline="families.zimage.tiny:build_tiny_pipeline",
    quantisation=QuantRules(
        prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*int4*", "*nf4*"),
        default_dense_base="Tongyi-MAI/Z-Image-Turbo",
        # Measured with bench/planner_accuracy.py --factors (full-size config, the
        # engine's module filter): int8 keeps modulation and embeddings in bf16.
        factors={"int8": 0.52},
        # int8 keeps the timestep embedder dense (M = batch).
        int8_dense_modules=("t_embedder",),
    ),
    single_file=SingleFileLayout(
        markers=("noise_refiner.", "context_refiner."),
    ),
    lora=LoraLayout(
        targets=("to_q", "to_k", "to_v", "to_out.0"),
        # LoRA keys: the refiner stacks and the ``layers.N.attention`` blocks.
        key_markers=("noise_refiner", "context_refiner", "layers.", "layers_", "_attention_", ".attention."),
    ),
    training=TrainingSpec(
        # How engine.testing.memory_figures builds the denoiser (real widths, reduced depths).
        # Its two noise (image) and two context (text) refiners are the same block class
        # on one stream each: a pair counts as one block.
        probe=MemoryProbe(
            model_class="ZImageTransformer2DModel",
            blocks=("ZImageTransformerBlock",),
            text_tokens=512,
            text_dim="cap_feat_dim",
            half_blocks=("noise_refiner.", "context_refiner."),
            derive={"n_layers": 2},
            deeper={"n_layers": 3},
            check={"n_layers": 4},
            narrow={"n_layers": 1, "dim": 256, "n_heads": 2, "n_kv_heads": 2},
        ),
        dense_gb=12.3,
        base_precision_applies=True,
        requires_bf16=True,
        # Z-Image's scheduler uses a static shift of 3.0 (no dynamic shifting):
        # training samples the same shifted sigmas.
        defaults=TrainingDefaults(
            learning_rate=1e-4, warmup_steps=10, flow_shift=3.0,
            source="Z-Image scheduler config: shift 3.0, use_dynamic_shifting false",
        ),
        objective=TrainingObjective(
            prediction="flow_matching",
            timestep_sampling="logit_normal",
        ),
        # Measured by `bench/memory_accuracy.py --derive` (bf16 LoRA step, rank 16,
        # real widths, 2 and 3 layers and the real 2 + 2 refiners). A noise
        # (image) and a context (text) refiner together count as one block:
        # 30 layers + 2 = 32.
        # Elements per token; outside includes the backward's transient at the
        # step's peak. Text: at most 512 positions (max_sequence_length, padded
        # to a multiple of 32 by the model), an upper bound for real captions.
        memory=TrainingMemoryFigures(
            activations=ActivationFigures(
                block_per_image_token=100156.0,
                block_per_text_token=100156.0,
                checkpointed_block_per_image_token=3840.0,
                checkpointed_block_per_text_token=3840.0,
                outside_per_image_token=35394.0,
                outside_per_text_token=35074.0,
                blocks=32,
                text_tokens=512,
            ),
            lora_targets=(
                LoraTargetShape("to_k", 3840, 3840, 34),
                LoraTargetShape("to_out.0", 3840, 3840, 34),
                LoraTargetShape("to_q", 3840, 3840, 34),
                LoraTargetShape("to_v", 3840, 3840, 34),
            ),
        ),
    ),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "Z-Image fails in attention under fp16 compute"),),
    ),
    pipeline=PipelineLayout(
        workflows=(("img2img", "ZImageImg2ImgPipeline"), ("inpaint", "ZImageInpaintPipeline")),
        cache_context_pipelines=(),
    ),
    speed=SpeedRules(
        compile_regions=("ZImageTransformerBlock",),
        eager_fusions=(FusionSite("ZImageTransformerBlock", 2),),
        optimization_deny=(
            OptimizationDeny(
                "step_cache",
                "diffusers' ZImageTransformer2DModel has no cache hooks (not a CacheMixin)",
            ),
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
