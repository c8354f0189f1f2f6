"""Wan (2.1 and 2.2): the family's data sheet. Pure data; no torch.

Figures (bf16 GB, from the published configs and the earlier system's tables):
the UMT5-XXL text encoder is 11.4 GB in every variant; the Wan 2.1 VAE is
0.5 GB and the Wan 2.2 VAE (48 channels, 16x) 2.8 GB, both as loaded in fp32,
which Wan's reference code keeps the VAE in. Denoisers: 1.3B 2.84 GB, 5B
10.0 GB, 14B 28.6 GB, the I2V 14B (an image cross-attention per block) 32.8 GB,
A14B's two 14B experts 57.2 GB together.

Every Wan VAE compresses time by 4 after a first frame of its own: a clip is
4k+1 frames. Wan 2.1 renders at 16 fps (81 frames, 5 s); Wan 2.2 TI2V-5B at
24 fps (121 frames), in multiples of 32 (its 16x VAE x patch 2).
"""

from engine.contract.types import (
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LatentGeometry,
    LoraLayout,
    PrecisionRules,
    QuantRules,
    SingleFileLayout,
    TrainingSpec,
    VideoMemory,
    VideoSpec,
)

#: What a clip holds at its peak (bench/video_memory.py --derive, at the real widths under fake
#: tensors): a denoiser forward's elements per latent token (by DiT width) and one tile's
#: decoder working set (Wan 2.1's 8x VAE; Wan 2.2's 16x one), beside the tile outputs.
_VAE21_TILE, _VAE22_TILE = 304.1e6, 338.2e6
_MEMORY_1_3B = VideoMemory(denoiser_per_token=24.58e3, decode_tile_elements=_VAE21_TILE)
_MEMORY_14B = VideoMemory(denoiser_per_token=56.83e3, decode_tile_elements=_VAE21_TILE)
_MEMORY_5B = VideoMemory(denoiser_per_token=41.47e3, decode_tile_elements=_VAE22_TILE)

#: Wan 2.1's clips: 16 fps, 81 frames; 480p (the 1.3B) and 720p (the 14B).
_WAN21_480P = VideoSpec(fps=16, default_frames=81, presets=((832, 480), (480, 832)), min_frames=5, max_frames=121,
                        memory=_MEMORY_1_3B)
_WAN21_720P = VideoSpec(fps=16, default_frames=81, presets=((1280, 720), (720, 1280), (832, 480), (480, 832)),
                        min_frames=5, max_frames=121, memory=_MEMORY_14B)
#: Wan 2.2 TI2V-5B: 24 fps, 121 frames, 704p, sides in multiples of 32.
_WAN22_TI2V = VideoSpec(fps=24, default_frames=121, presets=((1280, 704), (704, 1280)), min_frames=5,
                        max_frames=121, size_multiple=32, memory=_MEMORY_5B)

_UMT5_GB = 11.4
_I2V = (("img2vid", "WanImageToVideoPipeline"),)

WAN = FamilySpec(
    name="wan",
    label="Wan",
    aliases=("wan2.1", "wan2.2", "wan-video"),
    architecture="dit",
    pipeline_class="WanPipeline",
    pipeline_class_names=("WanPipeline", "WanImageToVideoPipeline"),
    output="frames",
    video=_WAN21_480P,
    checkpoints=(
        Checkpoint(
            name="wan2.2-ti2v-5b", label="Wan 2.2 TI2V-5B", repo="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
            default_steps=50, default_guidance=5.0, matches=("*wan2.2-ti2v-5b*", "*wan2_2-ti2v*", "*ti2v-5b*"),
            sizes=ComponentSizes(transformer_gb=10.0, text_encoders_gb=_UMT5_GB, vae_gb=2.8),
            # Text and image to video from one denoiser: the image is the first latent frame.
            workflows=(("txt2img", "WanPipeline"), *_I2V),
            video=_WAN22_TI2V,
            geometry=LatentGeometry(spatial_compression=16, patch_size=2, temporal_compression=4,
                                    latent_channels=48),
        ),
        Checkpoint(
            name="wan2.2-t2v-a14b", label="Wan 2.2 T2V-A14B", repo="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            default_steps=40, default_guidance=4.0, matches=("*wan2.2-t2v-a14b*", "*wan2_2-t2v-a14b*", "*t2v-a14b*"),
            sizes=ComponentSizes(transformer_gb=57.2, text_encoders_gb=_UMT5_GB, vae_gb=0.5),
            # transformer_2 takes the steps below the boundary (0.875 of the schedule) at its own guidance.
            expert_guidance=3.0,
            video=_WAN21_720P,
        ),
        Checkpoint(
            name="wan2.1-t2v-1.3b", label="Wan 2.1 T2V-1.3B", repo="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
            default_steps=50, default_guidance=5.0, matches=("*wan2.1-t2v-1.3b*", "*wan2_1-t2v-1_3b*", "*t2v-1.3b*"),
            sizes=ComponentSizes(transformer_gb=2.84, text_encoders_gb=_UMT5_GB, vae_gb=0.5),
        ),
        Checkpoint(
            name="wan2.1-t2v-14b", label="Wan 2.1 T2V-14B", repo="Wan-AI/Wan2.1-T2V-14B-Diffusers",
            default_steps=50, default_guidance=5.0, matches=("*wan2.1-t2v-14b*", "*wan2_1-t2v-14b*"),
            sizes=ComponentSizes(transformer_gb=28.6, text_encoders_gb=_UMT5_GB, vae_gb=0.5),
            video=_WAN21_720P,
        ),
        Checkpoint(
            name="wan2.1-i2v-14b", label="Wan 2.1 I2V-14B 720p", repo="Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
            default_steps=50, default_guidance=5.0, matches=("*wan2.1-i2v-14b*", "*wan2_1-i2v-14b*", "*i2v-14b*"),
            # Beside UMT5, its CLIP ViT-H image encoder (1.3 GB) conditions every block.
            sizes=ComponentSizes(transformer_gb=32.8, text_encoders_gb=_UMT5_GB + 1.3, vae_gb=0.5),
            pipeline_class="WanImageToVideoPipeline",
            workflows=_I2V,  # image to video only: a request without an image is refused
            video=_WAN21_720P,
        ),
    ),
    workflows=(("txt2img", "WanPipeline"),),
    sizes=ComponentSizes(transformer_gb=2.84, text_encoders_gb=_UMT5_GB, vae_gb=0.5),
    # Wan 2.1's VAE: 8x spatial, 4x temporal, 16 channels; the DiT patchifies (1, 2, 2).
    geometry=LatentGeometry(spatial_compression=8, patch_size=2, temporal_compression=4, latent_channels=16),
    side_multiple=16,
    experts=("transformer_2",),
    compile_regions=("WanTransformerBlock",),
    # WanPipeline opens "cond" / "uncond" cache contexts around each expert's call.
    cache_context_pipelines=("WanPipeline", "WanImageToVideoPipeline"),
    capabilities=Capabilities(step_cache=True, attention_dispatcher=True, peft_adapters=True,
                              regional_compile=True, pipeline_lora=True),
    # No runtime module: WanPipeline encodes its own prompts; the family is not trainable yet.
    runtime_module="",
    tiny_pipeline="families.wan.tiny:build_tiny_pipeline",
    quantisation=QuantRules(
        prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*nf4*"),
        default_dense_base="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        # The timestep and text projections run at M = batch or prompt tokens: kept dense.
        int8_dense_modules=("condition_embedder", "time_proj"),
    ),
    single_file=SingleFileLayout(markers=("blocks.0.self_attn.q", "blocks.0.cross_attn", "patch_embedding")),
    lora=LoraLayout(
        targets=("to_q", "to_k", "to_v", "to_out.0"),
        # Wan's top-level ``blocks.N`` (diffusers' ``transformer.blocks.N``, the original's
        # ``diffusion_model.blocks.N`` / kohya's ``lora_unet_blocks_N``) and the original's
        # self_attn / cross_attn; other DiTs name theirs ``transformer_blocks``, UNets ``attn1``.
        key_markers=("transformer.blocks.", "diffusion_model.blocks.", "lora_unet_blocks_", "self_attn", "cross_attn"),
    ),
    training=TrainingSpec(dense_gb=2.84),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "Wan's DiT is bf16-native: under fp16 its activations overflow"),),
        keep_fp32=(("vae", "the Wan VAE decodes in fp32 (bf16 gives banding and black frames)"),),
    ),
)
