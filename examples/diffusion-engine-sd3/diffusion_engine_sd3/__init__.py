"""An example third-party family plugin: Stable Diffusion 3.5 Medium.

It lives outside the engine's ``families/`` package and reaches the engine
only through the ``diffusion_engine.families`` entry point, exactly as a
package on PyPI would. Its figures are illustrative (bf16 bytes of the 2.5B
MMDiT, CLIP-L + CLIP-G + T5-XXL, and the VAE).

The package is the whole recipe: this table (pure data, no torch), the
torch code the trainer calls (``runtime.py``) and a tiny random-weight
pipeline builder (``tiny.py``) that the engine's contract kit runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.contract.hookspecs import hookimpl
from engine.contract.types import (
    ActivationFigures,
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LoraLayout,
    LoraTargetShape,
    MemoryProbe,
    PipelineLayout,
    Purpose,
    QuantDeny,
    QuantRules,
    SpeedRules,
    TrainingMemoryFigures,
    TrainingObjective,
    TrainingSpec,
)

SD3 = FamilySpec(
    name="sd3",
    label="Stable Diffusion 3.5",
    aliases=("sd3.5",),
    architecture="dit",
    pipeline_class="StableDiffusion3Pipeline",
    pipeline_class_names=("StableDiffusion3Pipeline",),
    checkpoints=(
        Checkpoint(
            name="sd3.5-medium",
            label="SD3.5 Medium",
            repo="stabilityai/stable-diffusion-3.5-medium",
            default_steps=40,
            default_guidance=4.5,
            matches=("*stable-diffusion-3.5-medium*", "*sd3.5-medium*"),
        ),
    ),
    sizes=ComponentSizes(transformer_gb=4.9, text_encoders_gb=11.1, vae_gb=0.2),
    runtime_module="diffusion_engine_sd3.runtime",
    tiny_pipeline="diffusion_engine_sd3.tiny:build_tiny_pipeline",
    # SD3Transformer2DModel (diffusers 0.3x-0.4x) has no cache hooks and its
    # JointAttnProcessor2_0 calls SDPA directly, not the attention dispatcher.
    capabilities=Capabilities(
        step_cache=False, attention_dispatcher=False, peft_adapters=True,
        regional_compile=True, pipeline_lora=True,
    ),
    quantisation=QuantRules(
        prequantised_patterns=("*nf4*",),
        # Derived with `python -m engine.testing.quant_factors --family sd3` (full size, the
        # engine's filter): its 24 joint blocks keep their adaLN modulation dense under int8,
        # so int8 holds 0.673 of bf16, heavier than the generic 0.55.
        factors={"int8": 0.673},
    ),
    lora=LoraLayout(
        targets=("to_q", "to_k", "to_v", "to_out.0"),
        # Spellings only SD3 LoRAs use (its original joint_blocks / x_block / context_block names).
        key_markers=("joint_blocks", "x_block", "context_block"),
    ),
    training=TrainingSpec(
        # Measured by `python -m engine.testing.memory_figures --derive --families sd3`
        # (bf16 LoRA step, rank 16, real widths, 2 and 4 layers). Elements per token; the
        # text figures outside the blocks come out negative in the fit (a fitted
        # offset against the image figures, not a count): the check below is what says
        # the estimate holds.
        memory=TrainingMemoryFigures(
            activations=ActivationFigures(
                block_per_image_token=41884.0,
                block_per_text_token=18580.0,
                checkpointed_block_per_image_token=769.0,
                checkpointed_block_per_text_token=2353.0,
                outside_per_image_token=12563.7,
                outside_per_text_token=-11965.8,
                blocks=24,
                text_tokens=154,
                checkpointed_outside_per_image_token=24251.7,
                checkpointed_outside_per_text_token=-3269.0,
            ),
            lora_targets=(
                LoraTargetShape("to_k", 1536, 1536, 37),
                LoraTargetShape("to_out.0", 1536, 1536, 37),
                LoraTargetShape("to_q", 1536, 1536, 37),
                LoraTargetShape("to_v", 1536, 1536, 37),
            ),
        ),
        # How the engine's training-memory tool builds the transformer (python -m
        # engine.testing.memory_figures --derive --families sd3): SD3.5 Medium's real
        # widths (diffusers' class defaults are SD3 Medium's); 77 CLIP + 77 T5 positions
        # (runtime.MAX_SEQUENCE_LENGTH).
        probe=MemoryProbe(
            model_class="SD3Transformer2DModel",
            blocks=("JointTransformerBlock",),
            text_tokens=154,
            text_dim="joint_attention_dim",
            pooled_dim=2048,
            full={"num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                  "pos_embed_max_size": 384, "qk_norm": "rms_norm", "dual_attention_layers": tuple(range(13))},
            # Reduced depths keep the real mix (13 of 24 blocks dual-attention, about half):
            # the two blocks the deeper one adds are one of each.
            derive={"num_layers": 2, "dual_attention_layers": (0,)},
            deeper={"num_layers": 4, "dual_attention_layers": (0, 1)},
            check={"num_layers": 6, "dual_attention_layers": (0, 1, 2)},
            narrow={"num_layers": 1, "num_attention_heads": 2, "caption_projection_dim": 128,
                    "dual_attention_layers": (0,)},
        ),
        dense_gb=4.9,
        base_precision_applies=True,
        requires_bf16=True,
        objective=TrainingObjective(prediction="flow_matching", timestep_sampling="logit_normal"),
    ),
    speed=SpeedRules(compile_regions=("JointTransformerBlock",)),
    pipeline=PipelineLayout(
        # StableDiffusion3Pipeline's call opens no cache context (First-Block-Cache needs one).
        cache_context_pipelines=(),
    ),
)


#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = 2


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(SD3)


@hookimpl
def engine_quant_deny(family: FamilySpec, purpose: Purpose) -> Iterable[QuantDeny] | None:
    """Code where a table cannot say it: nvfp4 is denied for every family
    whose transformer is under 6 GB, where 4-bit saves little and costs detail."""
    if purpose == "inference" and family.sizes.transformer_gb < 6:
        return (QuantDeny("nvfp4", "under 6 GB the 4-bit saving is not worth the detail lost"),)
    return None
