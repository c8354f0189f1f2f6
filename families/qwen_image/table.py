"""Qwen-Image: the family's data sheet. Pure data; no torch.

Figures: bf16 sizes of the 20B MMDiT (40.9 GB), the Qwen2.5-VL-7B text
encoder (16.6 GB) and its VAE (0.3 GB). The deny lists carry the same-seed
A/B measurements against the dense bf16 reference that justify them.
"""

from engine.types import Checkpoint, ComponentSizes, FamilySpec, QuantDeny, TrainingObjective

FP8_BLACK = (
    "per-row fp8 renders every Qwen-Image frame black (mean luma 0.0000, SSIM 0.016 "
    "against bf16): the model's activation range exceeds fp8"
)
MXFP8_DRIFT = (
    "mxfp8 damages Qwen-Image semantics at 1024px (CLIP-score delta mean 0.0146, "
    "worst 0.064 and 0.102)"
)
NVFP4_DRIFT = "nvfp4 measures LPIPS 0.51 against bf16 on Qwen-Image"

QWEN_IMAGE = FamilySpec(
    name="qwen_image",
    label="Qwen-Image",
    aliases=("qwen-image", "qwen"),
    architecture="dit",
    pipeline_class="QwenImagePipeline",
    pipeline_class_names=(
        "QwenImagePipeline",
        "QwenImageImg2ImgPipeline",
        "QwenImageEditPipeline",
        "QwenImageEditPlusPipeline",
    ),
    checkpoints=(
        Checkpoint(
            name="qwen-image",
            label="Qwen-Image",
            repo="Qwen/Qwen-Image",
            default_steps=20,
            default_guidance=4.0,
            matches=("*qwen-image*", "*qwen_image*"),
        ),
        Checkpoint(
            name="qwen-image-edit",
            label="Qwen-Image-Edit",
            repo="Qwen/Qwen-Image-Edit",
            default_steps=20,
            default_guidance=4.0,
            matches=("*qwen-image-edit*", "*qwen_image_edit*"),
        ),
    ),
    sizes=ComponentSizes(transformer_gb=40.9, text_encoders_gb=16.6, vae_gb=0.3),
    training_dense_gb=41.0,
    lora_targets=(
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    ),
    compile_regions=("QwenImageTransformerBlock",),
    fp16_compute_safe=False,
    fp16_unsafe_reason="Qwen-Image renders black frames in fp16 compute",
    base_precision_applies=True,
    training_requires_bf16=True,
    quant_deny={
        "inference": (
            QuantDeny("fp8", FP8_BLACK),
            QuantDeny("mxfp8", MXFP8_DRIFT),
            QuantDeny("nvfp4", NVFP4_DRIFT),
        ),
        "training": (
            QuantDeny("fp8", FP8_BLACK),
            QuantDeny("mxfp8", MXFP8_DRIFT),
        ),
    },
    prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*int4*", "*nf4*"),
    default_dense_base="Qwen/Qwen-Image",
    # Real classifier-free guidance: the pipeline's guidance knob is true_cfg_scale.
    guidance_kwarg="true_cfg_scale",
    # Measured with bench/planner_accuracy.py --factors (full-size config, the
    # engine's module filter): int8 keeps modulation and embeddings in bf16.
    quant_factors={"int8": 0.67},
    single_file_markers=("txt_norm.", "img_mod."),
    runtime_module="families.qwen_image.runtime",
    tiny_pipeline="families.qwen_image.tiny:build_tiny_pipeline",
    training_objective=TrainingObjective(
        prediction="flow_matching",
        timestep_sampling="logit_normal",
        runtime_module="families.qwen_image.runtime",
    ),
)
