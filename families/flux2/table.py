"""FLUX.2: the family's data sheet. Pure data; no torch.

Figures (bf16, decimal GB): klein 4B's 4B transformer (7.8), its Qwen3-4B text encoder
(8.0) and the 32-channel VAE (0.2); dev's 32B transformer (64.5), its Mistral-Small-24B
text encoder (48.0) and VAE (0.4). The transformer sizes agree with the diffusers class
at the published configs built on the meta device (64.45 and 7.75 GB).
"""

from engine.contract.types import (
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LatentGeometry,
    LoraLayout,
    PipelineLayout,
    QuantRules,
    Rendering,
    SingleFileLayout,
    SpeedRules,
    TrainingDefaults,
    TrainingObjective,
    TrainingSpec,
)

KLEIN_SIZES = ComponentSizes(transformer_gb=7.8, text_encoders_gb=8.0, vae_gb=0.2)
#: klein 9B from its published parameter counts (a 9B flow model, the Qwen3-8B embedder's 8.2B),
#: bf16 and rounded: no config of it is here to build on the meta device. A local folder or
#: file is sized from its own headers, which win over these.
KLEIN_9B_SIZES = ComponentSizes(transformer_gb=18.0, text_encoders_gb=16.4, vae_gb=0.2)
#: Reference images an edit takes (BFL's editing guide: klein up to 4, dev "recommended max 6").
KLEIN_REFERENCES = 4
#: Flux2ImageProcessor refuses an input image with a side under 64 pixels.
MIN_IMAGE_SIDE = 64
DEV_SIZES = ComponentSizes(transformer_gb=64.5, text_encoders_gb=48.0, vae_gb=0.4)


def _klein(params: str, sizes: ComponentSizes, *, base: bool, also: tuple[str, ...] = ()) -> Checkpoint:
    """A klein row: the step-distilled model (four steps, no classifier-free guidance), or its
    undistilled base (the one LoRAs train on: the full schedule and real CFG). ``also``: the
    wider name patterns the 4B rows answer to."""
    slug = f"klein-{'base-' if base else ''}{params}"
    return Checkpoint(
        name=f"flux.2-{slug}",
        label=f"FLUX.2 [klein] {'Base ' if base else ''}{params.upper()}",
        repo=f"black-forest-labs/FLUX.2-{slug[:-len(params)]}{params.upper()}",
        default_steps=50 if base else 4,
        default_guidance=4.0 if base else 1.0,
        matches=(f"*flux.2-{slug}*", f"*flux2-{slug}*", *also),
        sizes=sizes,
        reference_images=KLEIN_REFERENCES,
        min_image_side=MIN_IMAGE_SIDE,
        # BFL: LoRAs train on the undistilled base and apply to the distilled model.
        trained_on=None if base else f"flux.2-klein-base-{params}",
    )


FLUX2 = FamilySpec(
    name="flux2",
    label="FLUX.2",
    aliases=("flux.2", "flux_2"),
    architecture="dit",
    pipeline_class="Flux2KleinPipeline",
    pipeline_class_names=("Flux2KleinPipeline", "Flux2Pipeline"),
    checkpoints=(
        _klein("4b", KLEIN_SIZES, base=False, also=("*flux.2-klein*", "*flux2-klein*")),
        _klein("4b", KLEIN_SIZES, base=True, also=("*flux.2-klein-base*", "*flux2-klein-base*")),
        _klein("9b", KLEIN_9B_SIZES, base=False),
        _klein("9b", KLEIN_9B_SIZES, base=True),
        Checkpoint(
            name="flux.2-dev",
            label="FLUX.2 [dev]",
            repo="black-forest-labs/FLUX.2-dev",
            default_steps=28,
            default_guidance=4.0,
            matches=("*flux.2-dev*", "*flux2-dev*"),
            sizes=DEV_SIZES,
            pipeline_class="Flux2Pipeline",
            # Its own pipeline edits from reference images too; it has no inpaint pipeline.
            workflows=(("edit", "Flux2Pipeline"),),
            reference_images=6,
            min_image_side=MIN_IMAGE_SIDE,
            # Its Mistral-3 encoder and guidance embedding: a tiny pipeline of its own class.
            tiny_pipeline="families.flux2.tiny:build_tiny_dev_pipeline",
        ),
    ),
    sizes=KLEIN_SIZES,
    tiny_pipeline="families.flux2.tiny:build_tiny_pipeline",
    # A transformer file (BFL's original layout, ComfyUI's, or diffusers'): its global modulation
    # layers are FLUX.2's own (FLUX.1 modulates per block); its block names are FLUX.1's.
    single_file=SingleFileLayout(markers=("double_stream_modulation_img.", "single_stream_modulation.")),
    quantisation=QuantRules(
        prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*int4*", "*nf4*"),
        default_dense_base="black-forest-labs/FLUX.2-klein-4B",
        # Derived with the engine's factor tool (engine.testing.quant_factors) on the published
        # configs (meta device, the engine's filter); dev and klein 4B agree within 2% (int8:
        # 0.512 and 0.523). The modulation and the timestep embedder stay bf16 under int8.
        # fp8's own 0.501 (not the generic 0.55) is what lets dev's fp8 transformer sit
        # resident on a 48 GB card.
        factors={"int8": 0.52, "fp8": 0.501, "mxfp8": 0.516, "nvfp4": 0.282, "nf4": 0.281},
        int8_dense_modules=("time_guidance_embed",),
    ),
    # Flux2Transformer2DModel: a CacheMixin, attention through the dispatcher, peft's mixin, and its
    # repeated blocks compile regionally (checked on the tiny pipeline by the contract kit).
    capabilities=Capabilities(step_cache=True, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    runtime_module="families.flux2.runtime",
    training=TrainingSpec(
        # The dense denoiser a trainer holds (klein 4B; LoRAs train on its undistilled base).
        dense_gb=7.8,
        base_precision_applies=True,
        requires_bf16=True,
        # FLUX.2's scheduler shifts dynamically at inference; its LoRA recipes, as FLUX.1's,
        # sample logit-normal timesteps unshifted with a short warmup.
        defaults=TrainingDefaults(
            learning_rate=1e-4, warmup_steps=10, flow_shift=1.0,
            source="FLUX.1/FLUX.2 LoRA recipes: logit-normal timesteps, no shift, short warmup",
        ),
        objective=TrainingObjective(prediction="flow_matching", timestep_sampling="logit_normal"),
    ),
    lora=LoraLayout(
        # The double blocks' attention and feed-forward (both streams: ``ff`` and ``ff_context``)
        # and the single blocks' fused projection, as FLUX.2 LoRA recipes adapt them.
        targets=("to_q", "to_k", "to_v", "to_out.0", "linear_in", "linear_out", "to_qkv_mlp_proj"),
        # Keys only FLUX.2 LoRAs hold: its fused single-block projection and its feed-forward
        # names (FLUX.1's are ``ff.net.*``). Its attention keys are FLUX.1's spelling too, so an
        # attention-only FLUX.2 LoRA from elsewhere ties with FLUX.1 in a refusal's guess.
        key_markers=("to_qkv_mlp_proj", "linear_in", "linear_out"),
        # The kohya / ComfyUI export names modules as BFL's checkpoint does (``double_blocks``,
        # ``img_attn.qkv``, ``single_blocks.linear1``: the names diffusers' FLUX.2 kohya converter
        # reads back). q, k and v fuse into ``qkv``; a single block's projection is already fused.
        kohya_map=(
            ("double_blocks_{i}_img_attn_qkv", (
                "transformer_blocks.{i}.attn.to_q", "transformer_blocks.{i}.attn.to_k",
                "transformer_blocks.{i}.attn.to_v",
            )),
            ("double_blocks_{i}_img_attn_proj", ("transformer_blocks.{i}.attn.to_out.0",)),
            ("double_blocks_{i}_txt_attn_qkv", (
                "transformer_blocks.{i}.attn.add_q_proj", "transformer_blocks.{i}.attn.add_k_proj",
                "transformer_blocks.{i}.attn.add_v_proj",
            )),
            ("double_blocks_{i}_txt_attn_proj", ("transformer_blocks.{i}.attn.to_add_out",)),
            ("double_blocks_{i}_img_mlp_0", ("transformer_blocks.{i}.ff.linear_in",)),
            ("double_blocks_{i}_img_mlp_2", ("transformer_blocks.{i}.ff.linear_out",)),
            ("double_blocks_{i}_txt_mlp_0", ("transformer_blocks.{i}.ff_context.linear_in",)),
            ("double_blocks_{i}_txt_mlp_2", ("transformer_blocks.{i}.ff_context.linear_out",)),
            ("single_blocks_{i}_linear1", ("single_transformer_blocks.{i}.attn.to_qkv_mlp_proj",)),
            ("single_blocks_{i}_linear2", ("single_transformer_blocks.{i}.attn.to_out",)),
            ("img_in", ("x_embedder",)),
            ("txt_in", ("context_embedder",)),
            ("final_layer_linear", ("proj_out",)),
        ),
    ),
    pipeline=PipelineLayout(
        # The text-to-image pipelines edit too: given images, they are references the prompt
        # speaks of (no strength; the output is the size asked, else the first image's).
        # klein also inpaints with its own pipeline (a mask, a strength, optional references).
        workflows=(("edit", "Flux2KleinPipeline"), ("inpaint", "Flux2KleinInpaintPipeline")),
        # Flux2KleinPipeline opens a cache context around its transformer calls; Flux2Pipeline
        # (dev) does not, so First-Block-Cache is not engaged there.
        cache_context_pipelines=("Flux2KleinPipeline",),
    ),
    rendering=Rendering(
        # 8x VAE with 32 latent channels; the pipeline patchifies latents 2x2 (128 channels in).
        geometry=LatentGeometry(spatial_compression=8, patch_size=2, latent_channels=32),
        vae_decode_per_pixel=768.0,
    ),
    speed=SpeedRules(compile_regions=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"), context_parallel=True),
)
