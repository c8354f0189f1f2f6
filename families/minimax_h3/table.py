"""MiniMax-H3: the family's data sheet. Pure data; no torch.

Figures (bf16, decimal GB, FACTS.md): the audio-video DiT 66.3, its Qwen3-VL text encoder
66.8 (MiniMax-H3 reads its 50th hidden state), the video VAE with the audio VAE 11.1. It
exists only as diffusers' ``MiniMaxH3ModularPipeline``: blocks over a ``ComponentsManager``,
one packed sequence of text, video and audio rows denoised at once (two flow schedulers,
shift 12 for video and 3 for audio, stepped inside one transformer call). The checkpoint is
guidance-distilled: 30 steps, one forward pass each, no negative prompt. Its LoRAs train on
clips with their sound (both streams noised and predicted in one pass, a loss each). It renders at 24 fps
only, 17k+5 frames (124 to 345: 5 to 14.4 s; the pipeline snaps a count up to the lattice),
sides multiples of 32, with a 32 kHz stereo track as long as the clip.

Its repo holds two transformer partitions: ``transformer/`` for text and keyframe workflows
and ``transformer_ref/`` (another 61.7 GB) for the references workflow, which the engine
does not serve yet: that one is never required, sized or loaded.
"""

from engine.contract.types import (
    Capabilities,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    LatentGeometry,
    LoraLayout,
    PipelineLayout,
    PrecisionRules,
    Rendering,
    SoundTraining,
    SpeedRules,
    TrainingDefaults,
    TrainingObjective,
    TrainingSpec,
    VideoSpec,
)

#: The audio VAE's rate: the sound's sample rate in every clip.
AUDIO_RATE = 32000
PIPELINE_CLASS = "MiniMaxH3ModularPipeline"

CLIPS = VideoSpec(fps=24, default_frames=124,
                  presets=((1344, 768), (1536, 672), (1024, 768), (1024, 1024), (768, 1024), (768, 1344),
                           (960, 544), (544, 960)),
                  frame_step=17, frame_offset=5, latents_per_step=5, first_latents=2, min_frames=124, max_frames=345, size_multiple=32,
                  audio=True, audio_rate=AUDIO_RATE, fixed_fps=True)

MINIMAX_H3 = FamilySpec(
    name="minimax_h3",
    label="MiniMax-H3",
    aliases=("minimax-h3", "h3", "minimaxh3"),
    architecture="dit",
    pipeline_class=PIPELINE_CLASS,
    pipeline_class_names=(PIPELINE_CLASS,),
    checkpoints=(
        # Guidance-distilled: one pass a step, no CFG (the guidance argument is never passed).
        Checkpoint(name="minimax-h3", label="MiniMax-H3", repo="MiniMaxAI/MiniMax-H3", default_steps=30,
                   default_guidance=1.0, matches=("*minimax-h3*", "*minimax_h3*", "*h3*")),
    ),
    sizes=ComponentSizes(transformer_gb=66.3, text_encoders_gb=66.8, vae_gb=11.1),
    capabilities=Capabilities(step_cache=True, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    runtime_module="families.minimax_h3.runtime",
    tiny_pipeline="families.minimax_h3.tiny:build_tiny_pipeline",
    # Its text refiner is the transformer's own ``token_refiner`` (HunyuanVideo's is the context embedder's).
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0"), key_markers=("transformer.token_refiner.",)),
    training=TrainingSpec(
        dense_gb=66.3,
        requires_bf16=True,  # bf16-native: fp16 overflows (PrecisionRules below)
        objective=TrainingObjective(prediction="flow_matching", timestep_sampling="uniform"),
        # Trained on the schedules it samples: the picture's sigmas shifted by 12, the sound's by 3.
        defaults=TrainingDefaults(learning_rate=1e-4, warmup_steps=0, flow_shift=12.0,
                                  source="MiniMax-H3's own schedulers: video shift 12.0, audio 3.0"),
        sound=SoundTraining(flow_shift=3.0, loss_weight=1.0, channels=2),
    ),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "MiniMax-H3's DiT is bf16-native: under fp16 its activations overflow"),),
    ),
    rendering=Rendering(
        output="frames",
        video=CLIPS,
        geometry=LatentGeometry(spatial_compression=16, patch_size=2, temporal_compression=4, latent_channels=24),
    ),
    pipeline=PipelineLayout(
        # The modular pipeline picks its workflow from the inputs: text alone, or a first keyframe.
        workflows=(("txt2img", PIPELINE_CLASS), ("img2vid", PIPELINE_CLASS)),
        # Its denoiser has diffusers' cache hooks, but no block opens a cache context: no step cache.
        cache_context_pipelines=(),
        unused_components=("transformer_ref",),
    ),
    speed=SpeedRules(compile_regions=("MiniMaxH3TransformerBlock",), context_parallel=True),
)
