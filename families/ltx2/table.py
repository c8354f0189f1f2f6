"""LTX-2: the family's data sheet. Pure data; no torch.

Figures (bf16, decimal GB, FACTS.md): the 19B audio-video DiT 37.8, its Gemma-3-12B text
encoder 24.4, the video VAE with the audio VAE and the vocoder 5.5 (counted as the VAE:
all three decode). The video VAE compresses 32x in space and 8x in time (128 channels) and
the DiT takes 1x1 patches: clips are 8k+1 frames at 24 fps (121 by default), sides multiples
of 32; dev samples 40 steps at guidance 4.0, the distilled checkpoint its 8 sigmas at 1.0. The
pipeline renders a stereo track beside the frames, 24 kHz from its vocoder, as
long as the clip: its ``frame_rate`` argument (the engine passes the request's fps) sets it.
Its LoRAs train on clips with their sound (read at the audio VAE's 16 kHz) and on stills as
one-frame clips (``families.ltx2.runtime``).
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

#: The vocoder's output rate: the sound's sample rate in every clip.
AUDIO_RATE = 24000
#: The schedule the distilled checkpoints sample, from pure noise (diffusers' ``ltx2/utils.py``).
DISTILLED_SIGMAS = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875)

CLIPS = VideoSpec(fps=24, default_frames=121, presets=((768, 512), (1216, 704), (704, 1216), (512, 768)),
                  frame_step=8, frame_offset=1, min_frames=9, max_frames=257, size_multiple=32,
                  audio=True, audio_rate=AUDIO_RATE)

LTX2 = FamilySpec(
    name="ltx2",
    label="LTX-2",
    aliases=("ltx-2", "ltx_2", "ltxv2"),
    architecture="dit",
    pipeline_class="LTX2Pipeline",
    pipeline_class_names=("LTX2Pipeline",),
    checkpoints=(
        Checkpoint(name="ltx-2", label="LTX-2", repo="Lightricks/LTX-2", default_steps=40, default_guidance=4.0,
                   matches=("*ltx-2*", "*ltx2*")),
        # Distilled: eight steps on its own sigma schedule, no classifier-free guidance.
        Checkpoint(name="ltx-2.3-distilled", label="LTX-2.3 Distilled", repo="diffusers/LTX-2.3-Distilled-Diffusers",
                   default_steps=8, default_guidance=1.0, sigmas=DISTILLED_SIGMAS,
                   matches=("*ltx-2*distilled*", "*ltx2*distilled*")),
    ),
    sizes=ComponentSizes(transformer_gb=37.8, text_encoders_gb=24.4, vae_gb=5.5),
    capabilities=Capabilities(step_cache=True, attention_dispatcher=True, peft_adapters=True, regional_compile=True),
    runtime_module="families.ltx2.runtime",
    tiny_pipeline="families.ltx2.tiny:build_tiny_pipeline",
    lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out.0")),
    training=TrainingSpec(
        dense_gb=37.8,
        requires_bf16=True,  # bf16-native: fp16 overflows (PrecisionRules below)
        objective=TrainingObjective(prediction="flow_matching", timestep_sampling="logit_normal"),
        # Trained on the sigmas it samples: its scheduler shifts by the token count (0.95 at 1024
        # tokens to 2.05 at 4096, exponential).
        defaults=TrainingDefaults(learning_rate=1e-4, warmup_steps=0, flow_shift_auto=True, base_shift=0.95,
                                  max_shift=2.05, base_seq_len=1024, max_seq_len=4096,
                                  source="LTX2Pipeline's scheduler (dynamic shift 0.95-2.05 over 1024-4096 tokens)"),
        # The sound on the picture's schedule, read at the audio VAE's 16 kHz (its vocoder writes 24 kHz).
        sound=SoundTraining(sample_rate=16000),
    ),
    precision=PrecisionRules(
        fp16_unsafe=(("denoiser", "LTX-2's DiT is bf16-native: under fp16 its activations overflow"),),
    ),
    rendering=Rendering(
        output="frames",
        video=CLIPS,
        geometry=LatentGeometry(spatial_compression=32, patch_size=1, temporal_compression=8, latent_channels=128),
    ),
    pipeline=PipelineLayout(
        # Text to video, and image to video over the same components (the image is the first frame).
        workflows=(("txt2img", "LTX2Pipeline"), ("img2vid", "LTX2ImageToVideoPipeline")),
        # Both open a cache context around each of their transformer passes.
        cache_context_pipelines=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
    ),
    speed=SpeedRules(compile_regions=("LTX2VideoTransformerBlock",), context_parallel=True),
)
