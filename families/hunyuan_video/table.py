"""HunyuanVideo 1.5: the family's data sheet. Pure data; no torch.

Figures (bf16 GB, from the earlier system's tables): the 8.3B DiT 16.6 GB, its
encoders (Qwen2.5-VL-7B's language model and the ByT5 glyph encoder) 14.8 GB, the
VAE 2.4 GB. The VAE compresses 16x in space and 4x in time (32 channels) and the
DiT takes 1x1 patches: one token per 16x16 pixels of each latent frame. Clips are
4k+1 frames at 24 fps (121 by default); 480p and 720p are separate checkpoints.

Its CFG lives on the pipeline's ``guider`` (``guidance_kwarg="guider.guidance_scale"``)
and its call takes no step callback: the engine follows the scheduler's steps instead.
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
    QuantRules,
    Rendering,
    SpeedRules,
    TrainingSpec,
    VideoSpec,
)

_480P = VideoSpec(fps=24, default_frames=121, presets=((832, 480), (480, 832), (640, 640)), min_frames=5,
                  max_frames=121)
_720P = VideoSpec(fps=24, default_frames=121, presets=((1280, 720), (720, 1280), (960, 960)), min_frames=5,
                  max_frames=121)

HUNYUAN_VIDEO = FamilySpec(
    name="hunyuan_video",
    label="HunyuanVideo 1.5",
    aliases=("hunyuanvideo", "hunyuan-video", "hunyuanvideo-1.5"),
    architecture="dit",
    pipeline_class="HunyuanVideo15Pipeline",
    pipeline_class_names=("HunyuanVideo15Pipeline",),
    checkpoints=(
        Checkpoint(
            name="hunyuanvideo-1.5-480p", label="HunyuanVideo 1.5 480p",
            repo="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
            default_steps=50, default_guidance=6.0, matches=("*hunyuanvideo-1.5*480p*", "*hunyuanvideo*1_5*480p*"),
        ),
        Checkpoint(
            name="hunyuanvideo-1.5-720p", label="HunyuanVideo 1.5 720p",
            repo="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
            default_steps=50, default_guidance=6.0, matches=("*hunyuanvideo-1.5*720p*", "*hunyuanvideo*1_5*720p*"),
            video=_720P,
        ),
    ),
    sizes=ComponentSizes(transformer_gb=16.6, text_encoders_gb=14.8, vae_gb=2.4),
    capabilities=Capabilities(step_cache=True, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    runtime_module="",
    tiny_pipeline="families.hunyuan_video.tiny:build_tiny_pipeline",
    quantisation=QuantRules(
        prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*nf4*"),
        default_dense_base="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
        int8_dense_modules=("time_embed", "context_embedder"),
    ),
    lora=LoraLayout(
        targets=("to_q", "to_k", "to_v", "to_out.0"),
        # Its text refiner sits under the context embedder (diffusers) or txt_in (the original); MiniMax-H3's,
        # also a ``token_refiner``, sits on the transformer itself.
        key_markers=("double_blocks", "img_attn_qkv", "txt_attn_qkv", "context_embedder.token_refiner",
                     "individual_token_refiner"),
    ),
    training=TrainingSpec(dense_gb=16.6),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "HunyuanVideo 1.5's DiT is bf16-native: under fp16 its activations overflow"),),
    ),
    rendering=Rendering(
        output="frames",
        video=_480P,
        geometry=LatentGeometry(spatial_compression=16, patch_size=1, temporal_compression=4, latent_channels=32),
    ),
    pipeline=PipelineLayout(
        workflows=(("txt2img", "HunyuanVideo15Pipeline"),),
        # The pipeline's guider holds the CFG scale: the call has no guidance argument.
        guidance_kwarg="guider.guidance_scale",
        cache_context_pipelines=("HunyuanVideo15Pipeline",),
    ),
    # Its guider runs the transformer once per condition, back to back (no context-parallel plan in diffusers).
    speed=SpeedRules(compile_regions=("HunyuanVideo15TransformerBlock",), cfg_parallel=True),
)
