"""Ideogram 4: the family's data sheet. Pure data; no torch.

Two transformers of one architecture denoise each step, both weighed: the conditional one reads
the prompt, the unconditional one (trained apart, with zeroed text features) gives the guidance
its other side; the step blends them, ``g * cond + (1 - g) * uncond`` (asymmetric CFG). Both are
counted, quantised and offloaded alike (``PipelineLayout.experts``). The prompt is read as
thirteen hidden states of Qwen3-VL-8B stacked per token.

Figures (bf16, decimal GB, FACTS.md): both transformers 37.2, the text encoder 16.3, the FLUX.2
VAE 0.2 (8x, 32 channels; the pipeline patches 2x2, so a token is 16 px). 48 steps on the model
card's guidance schedule: 7.0, then 3.0 for the last three "polish" steps. Native 2K (the
pipeline's default size is 2048 x 2048). Its fp8 repo stores the blocks' Linears as fp8 with
per-channel scales and q, k, v fused; the engine splits and dequantises them on load
(``STORED_FP8``); its nf4 repo loads as it is.
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
    SpeedRules,
    StoredLayout,
    TrainingSpec,
)

PIPELINE_CLASS = "Ideogram4Pipeline"
#: The model card's guidance, and the lighter guidance of its last "polish" steps.
GUIDANCE, POLISH_GUIDANCE, POLISH_STEPS = 7.0, 3.0, 3


def guidance_schedule(steps: int, guidance: float = GUIDANCE) -> tuple[float, ...]:
    """The model card's per-step schedule for ``steps``: ``guidance`` on every step but the
    last three, which polish at 3.0 (the pipeline's default for 48 steps: 45 x 7.0 + 3 x 3.0);
    a call of three steps or fewer guides them all at ``guidance``."""
    if steps <= POLISH_STEPS:
        return (guidance,) * steps
    return (guidance,) * (steps - POLISH_STEPS) + (POLISH_GUIDANCE,) * POLISH_STEPS


#: Ideogram's fp8 repo: the blocks' Linears in float8_e4m3fn with per-output-channel scales,
#: q, k and v fused (``attention.qkv``) and the output projection named ``attention.o``.
STORED_FP8 = StoredLayout(
    name="fp8_fused_qkv", marker=".attention.qkv.weight", convert="families.ideogram4.stored:split_fused_fp8",
    note="fp8 weights dequantised by their per-channel scales; each fused qkv split into to_q, to_k, to_v",
)

IDEOGRAM4 = FamilySpec(
    name="ideogram4",
    label="Ideogram 4",
    aliases=("ideogram-4", "ideogram_4", "ideogram-v4", "ideogram"),
    architecture="dit",
    pipeline_class=PIPELINE_CLASS,
    pipeline_class_names=(PIPELINE_CLASS,),
    checkpoints=(
        Checkpoint(name="ideogram-4", label="Ideogram 4", repo="ideogram-ai/ideogram-v4", default_steps=48,
                   default_guidance=GUIDANCE, matches=("*ideogram-v4*", "*ideogram-4*", "*ideogram4*",
                                                       "*ideogram_4*")),
    ),
    sizes=ComponentSizes(transformer_gb=37.2, text_encoders_gb=16.3, vae_gb=0.2),
    # Ideogram4Transformer2DModel: no cache hooks (not a CacheMixin: no step cache), attention
    # through the dispatcher, peft's mixin, and its repeated blocks compile regionally (checked
    # on the tiny pipeline by the contract kit).
    capabilities=Capabilities(step_cache=False, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    tiny_pipeline="families.ideogram4.tiny:build_tiny_pipeline",
    # LoRAs adapt the conditional transformer (diffusers' loader); ai-toolkit's keep the
    # original names, which only Ideogram has (``attention.o``, lower-case ``adaln_modulation``).
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0"),
                    key_markers=("adaln_modulation", ".attention.o.", "_attention_o.", "conditional_transformer.")),
    # A LoRA adapts the conditional transformer alone: half the pair (no trainer here yet).
    training=TrainingSpec(dense_gb=18.6),
    quantisation=QuantRules(stored_layouts=(STORED_FP8,)),
    # The unconditional transformer denoises beside the conditional one, every step.
    pipeline=PipelineLayout(experts=("unconditional_transformer",), cache_context_pipelines=()),
    speed=SpeedRules(compile_regions=("Ideogram4TransformerBlock",)),
    # Native 2K: the pipeline's default size (a request naming none) is 2048 x 2048.
    rendering=Rendering(geometry=LatentGeometry(spatial_compression=8, patch_size=2, latent_channels=32),
                        native_side=2048),
)
