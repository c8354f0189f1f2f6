"""Qwen-Image: the family's data sheet. Pure data; no torch.

Figures: bf16 sizes of the 20B MMDiT (40.9 GB), the Qwen2.5-VL-7B text
encoder (16.6 GB) and its VAE (0.3 GB). The deny lists carry the same-seed
A/B measurements against the dense bf16 reference that justify them.
"""

from engine.contract.types import (
    ActivationFigures,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    FewStepLora,
    FusionSite,
    LoraLayout,
    LoraTargetShape,
    MemoryProbe,
    PipelineLayout,
    PrecisionRules,
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

FP8_BLACK = (
    "per-row fp8 renders every Qwen-Image frame black (mean luma 0.0000, SSIM 0.016 "
    "against bf16): all-zero text rows get activation scale 0 and NaN; the installed "
    "torchao cannot floor the scale (activation_value_lb), which fixes it for inference "
    "(LPIPS 0.027-0.063)"
)
FP8_BLACK_TRAINING = (
    "per-row fp8 renders every Qwen-Image frame black (mean luma 0.0000, SSIM 0.016 "
    "against bf16); the activation-scale floor that fixes inference is not measured "
    "for training"
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
            pipeline_class="QwenImageEditPipeline",
            # Its pipeline needs an input image: text-to-image runs the base
            # pipeline over the same components.
            workflows=(
                ("txt2img", "QwenImagePipeline"),
                ("edit", "QwenImageEditPipeline"),
                ("inpaint", "QwenImageEditInpaintPipeline"),
            ),
            tiny_pipeline="families.qwen_image.tiny:build_tiny_edit_pipeline",
        ),
        # The "Plus" edits: up to three input images (a person, a product, a scene) in one instruction.
        *(Checkpoint(
            name=f"qwen-image-edit-{version}",
            label=f"Qwen-Image-Edit-{version}",
            repo=f"Qwen/Qwen-Image-Edit-{version}",
            default_steps=20,
            default_guidance=4.0,
            matches=(f"*qwen-image-edit-{version}*", f"*qwen_image_edit_{version}*"),
            pipeline_class="QwenImageEditPlusPipeline",
            workflows=(("txt2img", "QwenImagePipeline"), ("edit", "QwenImageEditPlusPipeline")),
            reference_images=3,
            tiny_pipeline="families.qwen_image.tiny:build_tiny_edit_plus_pipeline",
        ) for version in ("2509", "2511")),
    ),
    sizes=ComponentSizes(transformer_gb=40.9, text_encoders_gb=16.6, vae_gb=0.3),
    runtime_module="families.qwen_image.runtime",
    tiny_pipeline="families.qwen_image.tiny:build_tiny_pipeline",
    quantisation=QuantRules(
        deny_training=(
                QuantDeny("fp8", FP8_BLACK_TRAINING),
                QuantDeny("mxfp8", MXFP8_DRIFT),
            ),
        deny_inference=(
                QuantDeny("fp8", FP8_BLACK),
                QuantDeny("mxfp8", MXFP8_DRIFT),
                QuantDeny("nvfp4", NVFP4_DRIFT),
            ),
        prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*int4*", "*nf4*"),
        default_dense_base="Qwen/Qwen-Image",
        # Measured with bench/planner_accuracy.py --factors (full-size config, the
        # engine's module filter): int8 keeps modulation and embeddings in bf16.
        factors={"int8": 0.67},
        # The inference build also keeps the text stream (int8_dense_modules,
        # about a third of the weights) in bf16: measured on the full-size config
        # (meta device) with the filter and those tokens.
        inference_factors={"int8": 0.83},
        # CUDA's int8 matmul needs M >= 16 rows, and the text stream runs at
        # M = prompt tokens (unpadded): short prompts would fail. bf16 there costs
        # almost nothing in speed.
        int8_dense_modules=("txt_in", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_mlp"),
        # fp8 is allowed for inference where torchao floors the fp8 activation
        # scales (activation_value_lb), which the runtime then always sets.
        deny_lifted_by={"fp8": "fp8_activation_floor"},
        # int8 text encoders run with this keep-in-bf16 schedule (as the earlier
        # system ran Qwen-Image's): Qwen2.5-VL's vision tower (unused for text,
        # kept as loaded), its token embeddings and its output head stay bf16.
        text_encoder_int8_keep=("visual", "embed_tokens", "lm_head"),
    ),
    single_file=SingleFileLayout(
        markers=("txt_norm.", "img_mod."),
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
        # LoRA keys: the dual-stream MLP and modulation names (diffusers, kohya
        # and ComfyUI spell them alike); the image MLP by its ``net`` (Qwen-Image 2.1's
        # SwiGLU is an ``img_mlp`` too).
        key_markers=("img_mlp.net", "img_mlp_net", "txt_mlp", "img_mod", "txt_mod"),
        # Lightning (lightx2v's step distillation): 4 or 8 steps without CFG, by its file names
        # (``Qwen-Image-Lightning-4steps-V1.0.safetensors``, ``...-Edit-Lightning-8steps-...``).
        # Lightning's own scheduler config holds the shift at 3 (base_shift = max_shift = ln 3).
        few_step=(FewStepLora("Qwen-Image-Lightning, 4 steps", "*lightning*4step*", steps=4, guidance=1.0, shift=3.0),
                  FewStepLora("Qwen-Image-Lightning, 8 steps", "*lightning*8step*", steps=8, guidance=1.0, shift=3.0)),
    ),
    training=TrainingSpec(
        # How engine.testing.memory_figures builds the denoiser (real widths, reduced depths).
        probe=MemoryProbe(
            model_class="QwenImageTransformer2DModel",
            blocks=("QwenImageTransformerBlock",),
            # encode_prompt truncates to max_sequence_length (512): the upper bound.
            text_tokens=512,
            text_dim="joint_attention_dim",
            derive={"num_layers": 2},  # a single block is also the last: its text stream is dropped
            deeper={"num_layers": 3},
            check={"num_layers": 4},
            narrow={"num_layers": 1, "num_attention_heads": 2},
        ),
        dense_gb=41.0,
        base_precision_applies=True,
        requires_bf16=True,
        # Qwen-Image's scheduler shifts by resolution (exponential, mu from 0.5
        # at 256 image tokens to 0.9 at 8192): training shifts the same way, so
        # a 1328 px LoRA trains on the sigmas it samples with.
        defaults=TrainingDefaults(
            learning_rate=1e-4, warmup_steps=20, flow_shift_auto=True,
            base_shift=0.5, max_shift=0.9, base_seq_len=256, max_seq_len=8192,
            source="Qwen-Image scheduler config: use_dynamic_shifting, base_shift 0.5, max_shift 0.9, "
            "base_image_seq_len 256, max_image_seq_len 8192, exponential",
        ),
        objective=TrainingObjective(
            prediction="flow_matching",
            timestep_sampling="logit_normal",
        ),
        # Measured by `bench/memory_accuracy.py --derive` (bf16 LoRA step, rank 16,
        # real widths, 2 and 3 blocks). Elements per token; outside includes the
        # backward's transient at the step's peak. Text: the prompt is truncated
        # to 512 positions (max_sequence_length), an upper bound for real captions.
        memory=TrainingMemoryFigures(
            activations=ActivationFigures(
                block_per_image_token=61716.0,
                block_per_text_token=61716.0,
                checkpointed_block_per_image_token=3072.0,
                checkpointed_block_per_text_token=3072.0,
                outside_per_image_token=22589.7,
                outside_per_text_token=26119.0,
                blocks=60,
                text_tokens=512,
            ),
            lora_targets=(
                LoraTargetShape("add_k_proj", 3072, 3072, 60),
                LoraTargetShape("add_q_proj", 3072, 3072, 60),
                LoraTargetShape("add_v_proj", 3072, 3072, 60),
                LoraTargetShape("to_add_out", 3072, 3072, 60),
                LoraTargetShape("to_k", 3072, 3072, 60),
                LoraTargetShape("to_out.0", 3072, 3072, 60),
                LoraTargetShape("to_q", 3072, 3072, 60),
                LoraTargetShape("to_v", 3072, 3072, 60),
            ),
        ),
    ),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "Qwen-Image renders black frames in fp16 compute"),),
    ),
    pipeline=PipelineLayout(
        workflows=(("img2img", "QwenImageImg2ImgPipeline"), ("inpaint", "QwenImageInpaintPipeline")),
        # Real classifier-free guidance: the pipeline's guidance knob is true_cfg_scale.
        guidance_kwarg="true_cfg_scale",
        # Every Qwen-Image pipeline opens a cache context around its transformer calls.
        cache_context_pipelines=(
            "QwenImagePipeline",
            "QwenImageImg2ImgPipeline",
            "QwenImageEditPipeline",
            "QwenImageEditPlusPipeline",
        ),
    ),
    speed=SpeedRules(
        compile_regions=("QwenImageTransformerBlock",),
        context_parallel=True,  # QwenImageTransformer2DModel declares diffusers' context-parallel plan
        eager_fusions=(FusionSite("QwenImageTransformerBlock", 5, ("forward", "_modulate")),),
    ),
    rendering=Rendering(
        # Qwen-Image's causal VAE decodes at 96 channels at full resolution:
        # about six such tensors live at once (6 x 96). Derived from the
        # architecture, not yet benchmarked.
        vae_decode_per_pixel=576.0,
    ),
)
