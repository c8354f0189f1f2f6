"""Z-Image: the family's data sheet. Pure data; no torch.

Figures: bf16 sizes of the 6B single-stream DiT (12.3 GB), the Qwen3-4B text
encoder (8.0 GB) and the 16-channel VAE (0.2 GB).
"""

from engine.types import (
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    OptimizationDeny,
    TrainingObjective,
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
    training_dense_gb=12.3,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    compile_regions=("ZImageTransformerBlock",),
    fp16_compute_safe=False,
    fp16_unsafe_reason="Z-Image fails in attention under fp16 compute",
    base_precision_applies=True,
    training_requires_bf16=True,
    prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*int4*", "*nf4*"),
    default_dense_base="Tongyi-MAI/Z-Image-Turbo",
    # Measured with bench/planner_accuracy.py --factors (full-size config, the
    # engine's module filter): int8 keeps modulation and embeddings in bf16.
    quant_factors={"int8": 0.52},
    single_file_markers=("noise_refiner.", "context_refiner."),
    optimization_deny=(
        OptimizationDeny(
            "step_cache",
            "diffusers' ZImageTransformer2DModel has no cache hooks (not a CacheMixin)",
        ),
    ),
    runtime_module="families.zimage.runtime",
    tiny_pipeline="families.zimage.tiny:build_tiny_pipeline",
    training_objective=TrainingObjective(
        prediction="flow_matching",
        timestep_sampling="logit_normal",
        runtime_module="families.zimage.runtime",
    ),
)
