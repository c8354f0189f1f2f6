"""Qwen-Image 2.1: the family's data sheet. Pure data; no torch.

One pipeline (``QwenImage21Pipeline``) generates and edits: with no image it draws from the
prompt, with one to ten reference images it edits or composes them, the images read both by its
Qwen3-VL-8B encoder (as vision tokens inside the prompt) and by its VAE (as latent tokens the
target attends to). The VAE has four channels: images come out RGBA and references keep their
alpha (``Rendering.alpha``). Its transformer is single-stream and block-causal, with text and
reference tokens modulated from t = 0, so their keys and values are computed on the first step
and cached (the pipeline's ``use_kv_cache``): an edit's references cost one pass, not one a step.

Figures (bf16, decimal GB): the 7B transformer 14.2 (its config, 32 blocks of 4096), the
Qwen3-VL-8B encoder 17.5 (8.77 B parameters), the VAE 0.7 (its config). 40 steps without
guidance (the pipeline's default: ``true_cfg_scale`` 1.0, "meant to be sampled without
guidance"); sides multiples of 32 (one encoder slot is 2x2 latent tokens of a 16x VAE).
"""

from engine.contract.types import (
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LatentGeometry,
    LoraLayout,
    PipelineLayout,
    PrecisionRules,
    Rendering,
    SpeedRules,
    TrainingDefaults,
    TrainingObjective,
    TrainingSpec,
)

PIPELINE_CLASS = "QwenImage21Pipeline"
#: The most reference images one edit takes (the model card's "up to 10").
REFERENCE_IMAGES = 10

QWEN_IMAGE21 = FamilySpec(
    name="qwen_image21",
    label="Qwen-Image 2.1",
    aliases=("qwen-image-2.1", "qwen-image-21", "qwen_image_2.1"),
    architecture="dit",
    pipeline_class=PIPELINE_CLASS,
    pipeline_class_names=(PIPELINE_CLASS,),
    checkpoints=(
        Checkpoint(name="qwen-image-2.1", label="Qwen-Image 2.1", repo="Qwen/Qwen-Image-2.1", default_steps=40,
                   default_guidance=1.0, matches=("*qwen-image-2.1*", "*qwen-image-21*", "*qwen_image_2.1*",
                                                  "*qwen-image2.1*", "*qwenimage21*"),
                   # One pipeline for both: no image draws, images edit (up to ten at once).
                   workflows=(("txt2img", PIPELINE_CLASS), ("edit", PIPELINE_CLASS)),
                   reference_images=REFERENCE_IMAGES),
    ),
    sizes=ComponentSizes(transformer_gb=14.2, text_encoders_gb=17.5, vae_gb=0.7),
    # QwenImage21Transformer2DModel: a CacheMixin, attention through the dispatcher, peft's mixin,
    # and its repeated blocks compile regionally (checked on the tiny pipeline by the contract kit).
    capabilities=Capabilities(step_cache=True, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    runtime_module="families.qwen_image21.runtime",
    tiny_pipeline="families.qwen_image21.tiny:build_tiny_pipeline",
    # The attention projections, named as in ComfyUI's layout (which fuses only the MLP's gate
    # and up projections): an export loads there as it is. Markers: its SwiGLU's names, which
    # a community LoRA adapting the MLP carries and Qwen-Image's (``img_mlp.net``) does not.
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0"),
                    key_markers=("img_mlp.gate_layer", "img_mlp_gate_layer", "img_mlp.gate_up", "img_mlp_gate_up")),
    training=TrainingSpec(
        dense_gb=14.2,
        requires_bf16=True,  # bf16-native (PrecisionRules below)
        objective=TrainingObjective(prediction="flow_matching", timestep_sampling="logit_normal"),
        # Trained on the sigmas it samples: its scheduler shifts by the token count
        # (0.5 at 256 tokens to 1.15 at 4096, exponential), as the pipeline's calculate_shift.
        defaults=TrainingDefaults(learning_rate=1e-4, warmup_steps=10, flow_shift_auto=True, base_shift=0.5,
                                  max_shift=1.15, base_seq_len=256, max_seq_len=4096,
                                  source="QwenImage21Pipeline's schedule (dynamic shift 0.5-1.15 over 256-4096 tokens)"),
    ),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "Qwen-Image 2.1 is bf16-native: its blocks clip fp16 activations at 65504"),),
    ),
    # Real classifier-free guidance where asked for (true_cfg_scale > 1 with a negative prompt);
    # its call opens cache contexts ("cond", "uncond") around the transformer.
    pipeline=PipelineLayout(guidance_kwarg="true_cfg_scale", cache_context_pipelines=(PIPELINE_CLASS,)),
    speed=SpeedRules(compile_regions=("QwenImage21TransformerBlock",)),
    rendering=Rendering(
        # A 16x VAE read unpatched; sides are multiples of 32 (an encoder slot is 2x2 tokens).
        geometry=LatentGeometry(spatial_compression=16, patch_size=1, latent_channels=64),
        side_multiple=32,
        alpha=True,
    ),
)
