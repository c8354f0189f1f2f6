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
    ActivationFigures,
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    FewStepLora,
    LatentGeometry,
    LoraLayout,
    LoraTargetShape,
    MemoryProbe,
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
#: A LoRA run trains 33-frame windows by default (about 2 s at 16 fps): the length the common
#: Wan LoRA recipes (diffusion-pipe's frame buckets, musubi-tuner's target frames) train motion at.
_TRAIN_FRAMES = 33
_WAN21_480P = VideoSpec(fps=16, default_frames=81, presets=((832, 480), (480, 832)), min_frames=5, max_frames=121,
                        memory=_MEMORY_1_3B, training_frames=_TRAIN_FRAMES)
_WAN21_720P = VideoSpec(fps=16, default_frames=81, presets=((1280, 720), (720, 1280), (832, 480), (480, 832)),
                        min_frames=5, max_frames=121, memory=_MEMORY_14B, training_frames=_TRAIN_FRAMES)
#: Wan 2.2 TI2V-5B: 24 fps, 121 frames, 704p, sides in multiples of 32.
_WAN22_TI2V = VideoSpec(fps=24, default_frames=121, presets=((1280, 704), (704, 1280)), min_frames=5,
                        max_frames=121, size_multiple=32, memory=_MEMORY_5B, training_frames=_TRAIN_FRAMES)

_UMT5_GB = 11.4
#: The original checkpoint's attention Linears and diffusers' names for them.
_ATTENTION = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))
#: What a LoRA step on the 1.3B keeps, per token (``python -m engine.testing.memory_figures --derive
#: --families wan``: a bf16 step, rank 16, real width, 2 and 6 blocks, 256 and 512 px, 9 frames).
#: An image token here is one token of a clip: latent frames x (side / 16) squared.
_TRAINING_MEMORY = TrainingMemoryFigures(
    activations=ActivationFigures(
        block_per_image_token=55298.0,
        block_per_text_token=12354.0,
        checkpointed_block_per_image_token=1536.0,
        checkpointed_block_per_text_token=0.0,
        outside_per_image_token=17212.0,
        outside_per_text_token=0.0,
        blocks=30,
        text_tokens=512,
        checkpointed_outside_per_image_token=20288.0,
        checkpointed_outside_per_text_token=1536.0,
    ),
    lora_targets=(
        LoraTargetShape("to_k", 1536, 1536, 60),
        LoraTargetShape("to_out.0", 1536, 1536, 60),
        LoraTargetShape("to_q", 1536, 1536, 60),
        LoraTargetShape("to_v", 1536, 1536, 60),
    ),
)
_I2V = (("img2vid", "WanImageToVideoPipeline"),)

WAN = FamilySpec(
    name="wan",
    label="Wan",
    aliases=("wan2.1", "wan2.2", "wan-video"),
    architecture="dit",
    pipeline_class="WanPipeline",
    pipeline_class_names=("WanPipeline", "WanImageToVideoPipeline"),
    checkpoints=(
        Checkpoint(
            name="wan2.2-ti2v-5b", label="Wan 2.2 TI2V-5B", repo="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
            default_steps=50, default_guidance=5.0, matches=("*wan2.2-ti2v-5b*", "*wan2_2-ti2v*", "*ti2v-5b*"),
            attention_heads=24,  # 3072 wide, heads of 128
            sizes=ComponentSizes(transformer_gb=10.0, text_encoders_gb=_UMT5_GB, vae_gb=2.8),
            # Text and image to video from one denoiser: the image is the first latent frame.
            workflows=(("txt2img", "WanPipeline"), *_I2V),
            video=_WAN22_TI2V,
            geometry=LatentGeometry(spatial_compression=16, patch_size=2, temporal_compression=4,
                                    latent_channels=48),
        ),
        Checkpoint(
            name="wan2.2-t2v-a14b", label="Wan 2.2 T2V-A14B", repo="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            # The publisher's recipe (its model card and diffusers' example: 40 steps, guidance 4.0 for the
            # high-noise expert, 3.0 for the low); the earlier system ran Wan 2.1's 50 / 5.0 here, a
            # departure kept and listed in docs/architecture.md.
            default_steps=40, default_guidance=4.0, matches=("*wan2.2-t2v-a14b*", "*wan2_2-t2v-a14b*", "*t2v-a14b*"),
            sizes=ComponentSizes(transformer_gb=57.2, text_encoders_gb=_UMT5_GB, vae_gb=0.5),
            # transformer_2 takes the steps below the boundary (0.875 of the schedule) at its own guidance.
            expert_guidance=3.0,
            attention_heads=40,
            video=_WAN21_720P,
        ),
        Checkpoint(
            name="wan2.1-t2v-1.3b", label="Wan 2.1 T2V-1.3B", repo="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
            default_steps=50, default_guidance=5.0, matches=("*wan2.1-t2v-1.3b*", "*wan2_1-t2v-1_3b*", "*t2v-1.3b*"),
            attention_heads=12,
            sizes=ComponentSizes(transformer_gb=2.84, text_encoders_gb=_UMT5_GB, vae_gb=0.5),
        ),
        Checkpoint(
            name="wan2.1-t2v-14b", label="Wan 2.1 T2V-14B", repo="Wan-AI/Wan2.1-T2V-14B-Diffusers",
            default_steps=50, default_guidance=5.0, matches=("*wan2.1-t2v-14b*", "*wan2_1-t2v-14b*"),
            attention_heads=40,  # 5120 wide, heads of 128
            sizes=ComponentSizes(transformer_gb=28.6, text_encoders_gb=_UMT5_GB, vae_gb=0.5),
            video=_WAN21_720P,
        ),
        Checkpoint(
            name="wan2.1-i2v-14b", label="Wan 2.1 I2V-14B 720p", repo="Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
            default_steps=50, default_guidance=5.0, matches=("*wan2.1-i2v-14b*", "*wan2_1-i2v-14b*", "*i2v-14b*"),
            attention_heads=40,
            # Beside UMT5, its CLIP ViT-H image encoder (1.3 GB) conditions every block.
            sizes=ComponentSizes(transformer_gb=32.8, text_encoders_gb=_UMT5_GB + 1.3, vae_gb=0.5),
            pipeline_class="WanImageToVideoPipeline",
            workflows=_I2V,  # image to video only: a request without an image is refused
            video=_WAN21_720P,
        ),
    ),
    sizes=ComponentSizes(transformer_gb=2.84, text_encoders_gb=_UMT5_GB, vae_gb=0.5),
    capabilities=Capabilities(step_cache=True, attention_dispatcher=True, peft_adapters=True,
                              regional_compile=True, pipeline_lora=True),
    # The trainer's torch code (prompts, clips to latents, the model call); inference needs none.
    runtime_module="families.wan.runtime",
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
        # The kohya / ComfyUI export names modules as the original checkpoint does (musubi-tuner's
        # layout, ``lora_unet_blocks_0_self_attn_q``), which ComfyUI's Wan loader and diffusers read.
        kohya_map=(
            *((f"blocks_{{i}}_self_attn_{o}", (f"blocks.{{i}}.attn1.{d}",)) for o, d in _ATTENTION),
            *((f"blocks_{{i}}_cross_attn_{o}", (f"blocks.{{i}}.attn2.{d}",)) for o, d in _ATTENTION),
            ("blocks_{i}_cross_attn_k_img", ("blocks.{i}.attn2.add_k_proj",)),
            ("blocks_{i}_cross_attn_v_img", ("blocks.{i}.attn2.add_v_proj",)),
            ("blocks_{i}_ffn_0", ("blocks.{i}.ffn.net.0.proj",)),
            ("blocks_{i}_ffn_2", ("blocks.{i}.ffn.net.2",)),
        ),
        # lightx2v's 4-step distillation of Wan 2.2, published as a high-noise and a low-noise
        # file (``..._4steps_..._high_noise.safetensors``): guidance 1 on both experts, each half
        # on its expert; the single-file 2.1 LoRAs (``lightx2v_..._4step...``) likewise.
        few_step=(
            # lightx2v samples its 4 steps at flow shift 5 (its inference configs' sample_shift).
            FewStepLora("lightx2v 4-step, low-noise half", "*4step*low*noise*", steps=4, guidance=1.0,
                        component="transformer_2", shift=5.0),
            FewStepLora("lightx2v 4-step, high-noise half", "*4step*high*noise*", steps=4, guidance=1.0, shift=5.0),
            FewStepLora("lightx2v 4-step", "*lightx2v*4step*", steps=4, guidance=1.0, shift=5.0),
        ),
    ),
    training=TrainingSpec(
        dense_gb=2.84,
        base_precision_applies=True,
        requires_bf16=True,  # bf16-native: fp16 overflows (PrecisionRules below)
        objective=TrainingObjective(prediction="flow_matching", timestep_sampling="uniform"),
        # Wan LoRA recipes (musubi-tuner's Wan guide: shift sampling, discrete_flow_shift 3.0;
        # the 480p scheduler's own shift) train on uniformly drawn, shifted sigmas.
        defaults=TrainingDefaults(
            learning_rate=1e-4, warmup_steps=0, flow_shift=3.0,
            source="Wan 2.1 LoRA recipes: uniform sigmas shifted by 3.0 (the 480p scheduler's shift), LR 1e-4",
        ),
        # How engine.testing.memory_figures builds the denoiser: Wan 2.1 T2V-1.3B at its real
        # width (12 heads of 128, FFN 8960), reduced depths, clips of 9 frames (3 latent frames).
        probe=MemoryProbe(
            model_class="WanTransformer3DModel",
            blocks=("WanTransformerBlock",),
            text_tokens=512,  # UMT5 padded to WanPipeline's max_sequence_length
            text_dim="text_dim",
            full={"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
            # Two and six blocks: at one and two, gradient checkpointing's peak falls elsewhere in
            # backward and over-counts what each of 30 blocks keeps (1.7x at full size).
            derive={"num_layers": 2},
            deeper={"num_layers": 6},
            check={"num_layers": 3},
            narrow={"num_attention_heads": 2, "ffn_dim": 512, "num_layers": 1},
            frames=9,
            check_frames=(17, 33),
        ),
        memory=_TRAINING_MEMORY,
    ),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "Wan's DiT is bf16-native: under fp16 its activations overflow"),),
        keep_fp32=(("vae", "the Wan VAE decodes in fp32 (bf16 gives banding and black frames)"),),
    ),
    rendering=Rendering(
        output="frames",
        video=_WAN21_480P,
        # Wan 2.1's VAE: 8x spatial, 4x temporal, 16 channels; the DiT patchifies (1, 2, 2).
        geometry=LatentGeometry(spatial_compression=8, patch_size=2, temporal_compression=4, latent_channels=16),
    ),
    pipeline=PipelineLayout(
        workflows=(("txt2img", "WanPipeline"),),
        experts=("transformer_2",),
        # WanPipeline opens "cond" / "uncond" cache contexts around each expert's call.
        cache_context_pipelines=("WanPipeline", "WanImageToVideoPipeline"),
        # WanPipeline hands each context the step, sigma and step count, and diffusers' SeaCache
        # has an adapter for a text-to-video WanTransformer3DModel; the image-to-video pipeline
        # hands none (SeaCache would run every step, saying nothing).
        sea_cache_pipelines=("WanPipeline",),
    ),
    # The prompt's projections (the text embedder, each block's cross-attention keys, values and
    # key norm) depend on the prompt alone: computed once per prompt per call.
    # WanTransformer3DModel declares diffusers' context-parallel plan; guidance runs it twice a step.
    speed=SpeedRules(compile_regions=("WanTransformerBlock",), context_parallel=True, cfg_parallel=True,
                     text_kv_sites=("condition_embedder.text_embedder", "attn2.to_k", "attn2.to_v", "attn2.norm_k")),
)
