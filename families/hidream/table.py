"""HiDream-I1: the family's data sheet. Pure data; no torch.

A 17B mixture-of-experts DiT (double- then single-stream blocks, four routed experts with two
active per token) read by four encoders: CLIP-L and CLIP-G (pooled), T5-XXL and Llama-3.1-8B
(every hidden state, the transformer picks its layers). Three checkpoints of one pipeline: Full
(50 steps, guidance 5.0), Dev (28, no CFG) and Fast (16, no CFG), distilled from Full.

Figures (bf16, decimal GB, FACTS.md): the transformer 34.2, the four encoders 28.8 (Llama 16.1
of it), the VAE 0.2 (FLUX.1's: 8x, 16 channels, 2x2 patches). HiDream's repos name the Llama
encoder and its tokenizer without shipping them (Llama is gated): a folder that lacks them takes
them from an ungated mirror (``PipelineLayout.borrowed``), or is refused before anything is
evicted.
"""

from engine.contract.types import (
    BorrowedComponent,
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LoraLayout,
    PipelineLayout,
    SpeedRules,
    TrainingSpec,
)

PIPELINE_CLASS = "HiDreamImagePipeline"
#: The ungated mirror of Llama-3.1-8B-Instruct the engine takes HiDream's fourth encoder from.
LLAMA_REPO = "unsloth/Meta-Llama-3.1-8B-Instruct"
#: Llama-3.1-8B in bf16, GB (8.03 B parameters).
LLAMA_GB = 16.1

HIDREAM = FamilySpec(
    name="hidream",
    label="HiDream-I1",
    aliases=("hidream-i1", "hidream_i1", "hi-dream"),
    architecture="dit",
    pipeline_class=PIPELINE_CLASS,
    pipeline_class_names=(PIPELINE_CLASS,),
    checkpoints=(
        Checkpoint(name="hidream-i1-full", label="HiDream-I1 Full", repo="HiDream-ai/HiDream-I1-Full",
                   default_steps=50, default_guidance=5.0, matches=("*hidream-i1-full*", "*hidream-i1*", "*hidream*")),
        Checkpoint(name="hidream-i1-dev", label="HiDream-I1 Dev", repo="HiDream-ai/HiDream-I1-Dev",
                   default_steps=28, default_guidance=0.0, matches=("*hidream-i1-dev*",)),
        Checkpoint(name="hidream-i1-fast", label="HiDream-I1 Fast", repo="HiDream-ai/HiDream-I1-Fast",
                   default_steps=16, default_guidance=0.0, matches=("*hidream-i1-fast*",)),
    ),
    sizes=ComponentSizes(transformer_gb=34.2, text_encoders_gb=28.8, vae_gb=0.2),
    # HiDreamImageTransformer2DModel: no cache hooks (no step cache), its own attention
    # processor (not the dispatcher), peft's mixin; no ``_repeated_blocks`` (no regional
    # compile). Checked on the tiny pipeline by the contract kit.
    capabilities=Capabilities(step_cache=False, attention_dispatcher=False, peft_adapters=True, regional_compile=False),
    tiny_pipeline="families.hidream.tiny:build_tiny_pipeline",
    # The blocks' attention, image and text streams (``to_q`` / ``to_q_t``, ...); its block
    # stacks' names are HiDream's alone.
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t", "to_out_t"),
                    key_markers=("double_stream_blocks", "single_stream_blocks")),
    # Not trainable here yet; a LoRA adapts the conditional denoiser's 34.2 GB.
    training=TrainingSpec(dense_gb=34.2),
    pipeline=PipelineLayout(
        cache_context_pipelines=(),
        borrowed=(BorrowedComponent("text_encoder_4", LLAMA_REPO, gb=LLAMA_GB),
                  BorrowedComponent("tokenizer_4", LLAMA_REPO)),
    ),
    speed=SpeedRules(compile_regions=()),
)
