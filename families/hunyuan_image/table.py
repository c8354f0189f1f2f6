"""HunyuanImage 2.1: the family's data sheet. Pure data; no torch.

A 17B DiT (double- then single-stream blocks and a token refiner) over a 32x VAE (64 channels,
patch 1: one token per 32 x 32 pixels, so 2K images are cheap), read by Qwen2.5-VL-7B (the
encoder Qwen-Image uses) and a ByT5 glyph encoder for text quoted in the prompt. 2K-native.

Figures (bf16, decimal GB, FACTS.md): the transformer 32.5, the encoders 16.3, the VAE 0.8.
The base samples 50 steps with real classifier-free guidance held by the repo's guiders
(adaptive projected guidance mixed with CFG, one for prompts with quoted text); the distilled
checkpoint samples 8 steps with the guidance embedded (``distilled_guidance_scale`` 3.25). The
call's knob is ``distilled_guidance_scale``; on the base, a guidance other than the default is
handed to its guiders (``hooks``). The refiner (``HunyuanImageRefinerPipeline``) is not served.
"""

from engine.contract.types import (
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LatentGeometry,
    LoraLayout,
    PipelineLayout,
    Rendering,
    SpeedRules,
    TrainingSpec,
)

PIPELINE_CLASS = "HunyuanImagePipeline"
#: The pipeline's and the earlier system's guidance (``distilled_guidance_scale``).
GUIDANCE = 3.25
#: The repo's guiders, which hold the base's real CFG.
GUIDERS = ("guider", "ocr_guider")

HUNYUAN_IMAGE = FamilySpec(
    name="hunyuan_image",
    label="HunyuanImage 2.1",
    aliases=("hunyuanimage", "hunyuan-image", "hunyuanimage-2.1", "hunyuan-image-2.1"),
    architecture="dit",
    pipeline_class=PIPELINE_CLASS,
    pipeline_class_names=(PIPELINE_CLASS,),
    checkpoints=(
        Checkpoint(name="hunyuanimage-2.1", label="HunyuanImage 2.1",
                   repo="hunyuanvideo-community/HunyuanImage-2.1-Diffusers", default_steps=50,
                   default_guidance=GUIDANCE, matches=("*hunyuanimage-2.1*", "*hunyuanimage2.1*", "*hunyuanimage*",
                                                       "*hunyuan-image*")),
        Checkpoint(name="hunyuanimage-2.1-distilled", label="HunyuanImage 2.1 Distilled",
                   repo="hunyuanvideo-community/HunyuanImage-2.1-Distilled-Diffusers", default_steps=8,
                   default_guidance=GUIDANCE, matches=("*hunyuanimage-2.1-distilled*", "*hunyuanimage*distilled*")),
    ),
    sizes=ComponentSizes(transformer_gb=32.5, text_encoders_gb=16.3, vae_gb=0.8),
    # HunyuanImageTransformer2DModel: a CacheMixin whose call the pipeline wraps in cache
    # contexts, attention through the dispatcher, peft's mixin, repeated blocks (checked by the kit).
    capabilities=Capabilities(step_cache=True, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    tiny_pipeline="families.hunyuan_image.tiny:build_tiny_pipeline",
    # The blocks' attention (image and text streams); its refiner's name is its own.
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                             "to_add_out"),
                    key_markers=("context_embedder.token_refiner", "context_embedder_2", "time_guidance_embed")),
    # Not trainable here yet.
    training=TrainingSpec(dense_gb=32.5),
    pipeline=PipelineLayout(guidance_kwarg="distilled_guidance_scale", cache_context_pipelines=(PIPELINE_CLASS,)),
    speed=SpeedRules(compile_regions=("HunyuanImageTransformerBlock", "HunyuanImageSingleTransformerBlock")),
    # A 32x VAE read unpatched: one token per 32 x 32 pixels.
    # 2K-native: its pipeline's default is 2048 x 2048 (64 latent tokens a side).
    rendering=Rendering(geometry=LatentGeometry(spatial_compression=32, patch_size=1, latent_channels=64),
                        native_side=2048),
)
