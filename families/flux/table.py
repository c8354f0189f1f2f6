"""FLUX.1: the family's data sheet. Pure data; no torch.

Figures: bf16 sizes of the 12B MMDiT (23.8 GB), CLIP-L + T5-XXL (9.8 GB) and
the 16-channel VAE (0.2 GB); sampling defaults per published checkpoint.
"""

from engine.types import Checkpoint, ComponentSizes, FamilySpec, TrainingObjective

FLUX = FamilySpec(
    name="flux",
    label="FLUX.1",
    aliases=("flux1", "flux.1"),
    architecture="dit",
    pipeline_class="FluxPipeline",
    pipeline_class_names=("FluxPipeline", "FluxImg2ImgPipeline", "FluxKontextPipeline"),
    checkpoints=(
        Checkpoint(
            name="flux.1-dev",
            label="FLUX.1-dev",
            repo="black-forest-labs/FLUX.1-dev",
            default_steps=28,
            default_guidance=3.5,
            matches=("*flux.1-dev*", "*flux1-dev*", "*flux-dev*"),
        ),
        Checkpoint(
            name="flux.1-schnell",
            label="FLUX.1-schnell",
            repo="black-forest-labs/FLUX.1-schnell",
            default_steps=4,
            default_guidance=0.0,
            matches=("*flux.1-schnell*", "*flux1-schnell*", "*flux-schnell*"),
        ),
        Checkpoint(
            name="flux.1-krea-dev",
            label="FLUX.1-Krea-dev",
            repo="black-forest-labs/FLUX.1-Krea-dev",
            default_steps=28,
            default_guidance=4.5,
            matches=("*flux.1-krea-dev*", "*flux1-krea*", "*flux-krea*"),
        ),
        Checkpoint(
            name="flux.1-kontext-dev",
            label="FLUX.1-Kontext-dev",
            repo="black-forest-labs/FLUX.1-Kontext-dev",
            default_steps=28,
            default_guidance=2.5,
            matches=("*flux.1-kontext-dev*", "*flux1-kontext*", "*flux-kontext*"),
        ),
    ),
    sizes=ComponentSizes(transformer_gb=23.8, text_encoders_gb=9.8, vae_gb=0.2),
    training_dense_gb=23.8,
    lora_targets=(
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    ),
    compile_regions=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    fp16_compute_safe=True,
    base_precision_applies=True,
    training_requires_bf16=True,
    prequantised_patterns=("*bnb-4bit*", "*-4bit*", "*int4*", "*nf4*"),
    default_dense_base="black-forest-labs/FLUX.1-dev",
    # Measured with bench/planner_accuracy.py --factors (full-size config, the
    # engine's module filter): int8 keeps modulation and embeddings in bf16.
    quant_factors={"int8": 0.64},
    single_file_markers=("single_transformer_blocks.", "double_blocks."),
    runtime_module="families.flux.runtime",
    tiny_pipeline="families.flux.tiny:build_tiny_pipeline",
    training_objective=TrainingObjective(
        prediction="flow_matching",
        timestep_sampling="logit_normal",
        runtime_module="families.flux.runtime",
    ),
)
