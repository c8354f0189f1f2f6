"""A Sana-shaped probe family for the suite: a 32x DC-AE with 1x1 patches (one token per
32x32 pixels), the geometry the engine once assumed away (8x, patch 2).

Not a served family (no pipeline, no checkpoints to load): the table the training-memory
tool needs (``SanaTransformer2DModel`` at Sana 1.6B's real widths, reduced depths) and the
runtime ``predict`` it calls, so tests/policy/test_geometry.py derives its figures and checks the
dry-run estimate against a measured LoRA step.
"""

from __future__ import annotations

from typing import Any

from engine.contract.types import (
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LatentGeometry,
    LoraLayout,
    MemoryProbe,
    Rendering,
    TrainingObjective,
    TrainingSpec,
)

#: Sana 1600M at 1024 px: 20 blocks, 2240 wide (70 heads x 32), Gemma-2 2B's 2304-wide text.
SANA_FULL = {"in_channels": 32, "out_channels": 32, "num_attention_heads": 70, "attention_head_dim": 32,
             "num_layers": 20, "num_cross_attention_heads": 20, "cross_attention_head_dim": 112,
             "cross_attention_dim": 2240, "caption_channels": 2304, "mlp_ratio": 2.5, "sample_size": 32,
             "patch_size": 1}


def sana_family(memory: Any = None) -> FamilySpec:
    """The probe family, with ``memory`` figures (None before ``--derive``)."""
    return FamilySpec(
        name="sana_probe", label="Sana (probe)", architecture="dit", pipeline_class="SanaPipeline",
        pipeline_class_names=("SanaPipeline",),
        checkpoints=(Checkpoint("sana-1.6b", "Sana 1.6B", "Efficient-Large-Model/Sana_1600M_1024px_diffusers",
                                20, 4.5, matches=("*sana*",)),),
        sizes=ComponentSizes(transformer_gb=3.2, text_encoders_gb=5.2, vae_gb=0.6),
        runtime_module="tests.sana_probe",
        lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0")),
        training=TrainingSpec(
            objective=TrainingObjective(prediction="flow_matching", timestep_sampling="logit_normal"),
            dense_gb=3.2, requires_bf16=True, memory=memory,
            probe=MemoryProbe(model_class="SanaTransformer2DModel", blocks=("SanaTransformerBlock",),
                              text_tokens=300, text_dim="caption_channels", derive={"num_layers": 2},
                              deeper={"num_layers": 3}, check={"num_layers": 4}, full=SANA_FULL,
                              latent_channels=32, narrow={"num_layers": 1, "num_attention_heads": 4,
                                                          "cross_attention_dim": 128,
                                                          "num_cross_attention_heads": 2,
                                                          "cross_attention_head_dim": 64}),
        ),
        rendering=Rendering(
            geometry=LatentGeometry(spatial_compression=32, patch_size=1, latent_channels=32),
            side_multiple=32,
        ),
    )


# -- the runtime the memory tool calls -----------------------------------------------------


def encode_prompts(pipe: Any, prompts: list[str], device: Any, dtype: Any) -> dict[str, Any]:
    raise NotImplementedError("the probe family measures a step; it encodes no prompts")


def encode_images(pipe: Any, pixels: Any) -> Any:
    raise NotImplementedError("the probe family measures a step; it encodes no images")


def predict(pipe: Any, denoiser: Any, noisy_latents: Any, timesteps: Any, conditioning: dict[str, Any]) -> Any:
    """Flow velocity from ``SanaTransformer2DModel`` (32-channel latents at 1/32 of the image,
    no packing), timesteps in the pipeline's 0-1000 scale."""
    embeds = conditioning["prompt_embeds"]
    out = denoiser(hidden_states=noisy_latents.to(embeds.dtype), encoder_hidden_states=embeds,
                   timestep=(timesteps * 1000).to(embeds.dtype), return_dict=False)[0]
    return out.to(noisy_latents.dtype)
