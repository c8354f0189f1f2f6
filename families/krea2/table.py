"""Krea 2: the family's data sheet. Pure data; no torch.

Figures (bf16, decimal GB, FACTS.md): the transformer 26.3, its Qwen3-VL-4B text encoder 8.9
(the pipeline stacks twelve of its hidden states per token), the Qwen-Image VAE 0.5 (8x, 16
channels; with the 2x2 patch a token is 16 px). Raw samples 52 steps at guidance 3.5 on a
schedule shifted by the image's size; Turbo is its 8-step distillation at guidance 0.0 (no
classifier-free guidance) on a fixed shift. LoRAs train on Raw and deploy on Turbo, as the
trainers people use for it do (ai-toolkit, musubi-tuner, diffusion-pipe, OneTrainer,
SimpleTuner). bf16 only: the model is bf16-native.
"""

from engine.contract.types import (
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LoraLayout,
    PipelineLayout,
    PrecisionRules,
    SpeedRules,
    TrainingDefaults,
    TrainingObjective,
    TrainingSpec,
)

PIPELINE_CLASS = "Krea2Pipeline"

KREA2 = FamilySpec(
    name="krea2",
    label="Krea 2",
    aliases=("krea-2", "krea_2", "krea"),
    architecture="dit",
    pipeline_class=PIPELINE_CLASS,
    pipeline_class_names=(PIPELINE_CLASS,),
    checkpoints=(
        Checkpoint(name="krea-2-raw", label="Krea 2 Raw", repo="krea/Krea-2-Raw", default_steps=52,
                   default_guidance=3.5, matches=("*krea-2-raw*", "*krea2-raw*", "*krea-2*", "*krea2*"),
                   index_settings=(("is_distilled", False),)),
        # Distilled: eight steps, no CFG; its LoRAs train on Raw (the engine swaps the base for a run).
        Checkpoint(name="krea-2-turbo", label="Krea 2 Turbo", repo="krea/Krea-2-Turbo", default_steps=8,
                   default_guidance=0.0, matches=("*krea-2-turbo*", "*krea2-turbo*"), trained_on="krea-2-raw",
                   # Its pipeline's own flag (the distilled schedule's fixed shift) says a folder is Turbo.
                   index_settings=(("is_distilled", True),), tiny_pipeline="families.krea2.tiny:build_tiny_turbo_pipeline"),
    ),
    sizes=ComponentSizes(transformer_gb=26.3, text_encoders_gb=8.9, vae_gb=0.5),
    # Krea2Transformer2DModel: no cache hooks (not a CacheMixin: no step cache), attention through
    # the dispatcher, peft's mixin, and its repeated blocks compile regionally (checked on the
    # tiny pipeline by the contract kit).
    capabilities=Capabilities(step_cache=False, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    runtime_module="families.krea2.runtime",
    tiny_pipeline="families.krea2.tiny:build_tiny_pipeline",
    # Its text fusion's attention is adapted too: ``text_fusion`` names only Krea 2's LoRAs.
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0"), key_markers=("text_fusion.",)),
    training=TrainingSpec(
        dense_gb=26.3,
        requires_bf16=True,  # bf16-native: fp16 overflows (PrecisionRules below)
        objective=TrainingObjective(prediction="flow_matching", timestep_sampling="logit_normal"),
        # Trained on the sigmas Raw samples: its scheduler shifts by the token count (0.5 at 256
        # tokens to 1.15 at 6400, exponential).
        defaults=TrainingDefaults(learning_rate=1e-4, warmup_steps=10, flow_shift_auto=True, base_shift=0.5,
                                  max_shift=1.15, base_seq_len=256, max_seq_len=6400,
                                  source="Krea2Pipeline's Raw schedule (dynamic shift 0.5-1.15 over 256-6400 tokens)"),
    ),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "Krea 2 is bf16-native: under fp16 its activations overflow"),),
    ),
    # Its call opens no cache context around the transformer (and the transformer has no cache hooks).
    pipeline=PipelineLayout(cache_context_pipelines=()),
    speed=SpeedRules(compile_regions=("Krea2TransformerBlock",)),
)
