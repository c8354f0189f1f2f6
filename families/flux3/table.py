"""FLUX.3: the family's data sheet. Pure data; no torch.

FLUX.3 exists only as diffusers' modular pipelines: ``Flux3ModularPipeline`` (50 steps with
classifier-free guidance, 3.5, held by its ``guider``) and ``Flux3DistilledModularPipeline``
(the step-distilled model: 16 steps, no guidance). Its transformer runs a few "mode" blocks
per stream (text, image, references) before single-stream blocks; the prompt is read as eight
hidden states of a Qwen3-VL encoder stacked per token, after an optional prompt upsampler (a
generative Qwen3.5 that rewrites it: a step of the blocks, run only where the folder ships it).

Its release's sizes are not published: the figures are ``Flux3Transformer2DModel``'s and
``AutoencoderKLFlux2``'s default configs counted on the meta device (diffusers 0.42.1: 11.1 and
0.2 GB in bf16), and the encoder its ``joint_attention_dim`` implies (20480 = 8 taps of 2560,
Qwen3-VL-4B: 8.9 GB). A local folder is sized from its own headers, as every folder is.
The checkpoints' repo ids are placeholders until the release names them; a folder is known
by its pipeline class.
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

PIPELINE_CLASS = "Flux3ModularPipeline"
DISTILLED_CLASS = "Flux3DistilledModularPipeline"
#: Where the sizes come from, as the plan says it.
SIZES_SOURCE = ("from Flux3Transformer2DModel's and AutoencoderKLFlux2's default configs and the Qwen3-VL-4B "
                "its joint_attention_dim implies; the release's sizes are not published")

FLUX3 = FamilySpec(
    name="flux3",
    label="FLUX.3",
    aliases=("flux-3", "flux.3", "flux_3"),
    architecture="dit",
    pipeline_class=PIPELINE_CLASS,
    pipeline_class_names=(PIPELINE_CLASS, DISTILLED_CLASS),
    checkpoints=(
        Checkpoint(name="flux3", label="FLUX.3", repo="black-forest-labs/FLUX.3", default_steps=50,
                   default_guidance=3.5, matches=("*flux.3*", "*flux3*", "*flux-3*")),
        Checkpoint(name="flux3-distilled", label="FLUX.3 Distilled", repo="black-forest-labs/FLUX.3-Distilled",
                   default_steps=16, default_guidance=0.0, pipeline_class=DISTILLED_CLASS,
                   workflows=(("txt2img", DISTILLED_CLASS),),
                   matches=("*flux.3-distilled*", "*flux3-distilled*", "*flux-3-distilled*"),
                   tiny_pipeline="families.flux3.tiny:build_tiny_distilled_pipeline"),
    ),
    sizes=ComponentSizes(transformer_gb=11.1, text_encoders_gb=8.9, vae_gb=0.2, source=SIZES_SOURCE),
    # Flux3Transformer2DModel: no cache hooks (no step cache), attention through the
    # dispatcher, peft's mixin, repeated blocks (checked on the tiny pipeline by the kit).
    capabilities=Capabilities(step_cache=False, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    tiny_pipeline="families.flux3.tiny:build_tiny_pipeline",
    # The blocks' attention; its per-mode block stacks are named as no other family's.
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0"),
                    key_markers=("mode_blocks.", "txt_mode_blocks", "mode_blocks_")),
    training=TrainingSpec(dense_gb=11.1),  # not trainable here yet
    pipeline=PipelineLayout(
        guidance_kwarg="guider.guidance_scale",
        workflows=(("txt2img", PIPELINE_CLASS),),
        cache_context_pipelines=(),
        optional_steps=(("prompt_upsampler", "prompt_upsampler"),),
    ),
    speed=SpeedRules(compile_regions=("Flux3ModeTransformerBlock", "Flux3SingleTransformerBlock")),
    # The FLUX.2 VAE (8x, 2x2 patches: a token is 16 px).
    rendering=Rendering(geometry=LatentGeometry(spatial_compression=8, patch_size=2, latent_channels=32)),
)
