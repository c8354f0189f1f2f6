"""Lumina 2: the family's data sheet. Pure data; no torch.

Figures (bf16, decimal GB, FACTS.md): the 2.6B transformer 5.2, its Gemma-2-2B text encoder
5.2 (the second-to-last hidden state conditions it), the FLUX.1 VAE 0.2 (8x, 16 channels; the
transformer patches 2x2). Its repo ships fp32. 50 steps at guidance 4.0, with classifier-free
guidance only over the first quarter of the schedule (``cfg_trunc_ratio=0.25``, the model
card's: the rest runs one pass a step). Named ``lumina2`` and ``lumina-image-2``, never bare
"lumina": Lumina-Next is another model.
"""

from engine.contract.types import (
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LoraLayout,
    PipelineLayout,
    SpeedRules,
    TrainingDefaults,
    TrainingObjective,
    TrainingSpec,
)

PIPELINE_CLASS = "Lumina2Pipeline"
#: The share of the schedule that runs classifier-free guidance (the model card's).
CFG_TRUNC_RATIO = 0.25

LUMINA2 = FamilySpec(
    name="lumina2",
    label="Lumina 2",
    aliases=("lumina-2", "lumina_2", "lumina-image-2", "lumina-image-2.0"),
    architecture="dit",
    pipeline_class=PIPELINE_CLASS,
    pipeline_class_names=(PIPELINE_CLASS,),
    checkpoints=(
        Checkpoint(name="lumina-image-2.0", label="Lumina-Image 2.0", repo="Alpha-VLLM/Lumina-Image-2.0",
                   default_steps=50, default_guidance=4.0, matches=("*lumina-image-2*", "*lumina2*", "*lumina-2*")),
    ),
    sizes=ComponentSizes(transformer_gb=5.2, text_encoders_gb=5.2, vae_gb=0.2),
    # Lumina2Transformer2DModel: no cache hooks (no step cache), its own attention processor (not
    # the dispatcher: no backend choice reaches it), peft's mixin, regional compile of its
    # repeated blocks (checked by the contract kit).
    capabilities=Capabilities(step_cache=False, attention_dispatcher=False, peft_adapters=True, regional_compile=True),
    runtime_module="families.lumina2.runtime",
    tiny_pipeline="families.lumina2.tiny:build_tiny_pipeline",
    # Its blocks' and refiners' attention. Z-Image (a Lumina descendant) names its blocks the same
    # (``layers``, ``noise_refiner``, ``context_refiner``) but its attention ``attention``: Lumina 2's
    # keys are told apart by ``<block>.<i>.attn.``, for each of its 26 layers and two refiners.
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0"), key_markers=(
        *(f"layers.{i}.attn." for i in range(26)),
        *(f"{stack}_refiner.{i}.attn." for stack in ("noise", "context") for i in range(2)),
    )),
    training=TrainingSpec(
        dense_gb=5.2,
        objective=TrainingObjective(prediction="flow_matching", timestep_sampling="logit_normal"),
        # Trained on the sigmas it samples: its scheduler shifts by the token count (diffusers'
        # FlowMatch defaults: 0.5 at 256 tokens to 1.15 at 4096).
        defaults=TrainingDefaults(learning_rate=1e-4, warmup_steps=10, flow_shift_auto=True,
                                  source="Lumina2Pipeline's schedule (dynamic shift 0.5-1.15 over 256-4096 tokens)"),
    ),
    # Its call opens no cache context around the transformer.
    pipeline=PipelineLayout(cache_context_pipelines=()),
    speed=SpeedRules(compile_regions=("Lumina2TransformerBlock",)),
)
