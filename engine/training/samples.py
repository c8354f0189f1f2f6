"""Sample images (a video family: short clips, MP4) during training, with the LoRA as it is now,
in the trainer's own pipeline.

No second model load: the pipeline the trainer loaded (its denoiser carries
the adapter being trained) renders each prompt with a fixed seed
(``config.seed + prompt index``), so samples at different steps differ only
by what the LoRA learned. The torch RNG is saved and restored around it, so
sampling never changes the training curve (a run with samples has the loss
of one without).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

SAMPLES = "samples"


def write_samples(plan: Any, pipe: Any, denoiser: torch.nn.Module, output_dir: Path, step: int) -> list[dict[str, object]]:
    """Render every sample prompt at ``step``; one ``{"step", "prompt", "path"}`` per image."""
    config = plan.config
    folder = output_dir / SAMPLES
    folder.mkdir(parents=True, exist_ok=True)
    rng = torch.get_rng_state()
    encoders = [c for n, c in pipe.components.items()
                if isinstance(c, torch.nn.Module) and n not in plan.trained_components]
    for component in encoders:
        component.to(plan.device)  # the trainer parked them on the host after caching
    was_training = denoiser.training
    denoiser.eval()
    written: list[dict[str, object]] = []
    try:
        for index, prompt in enumerate(config.sample_prompts or ()):
            with torch.no_grad():  # not inference_mode: lazily built buffers must stay usable in training
                output = pipe(**_call_kwargs(plan, pipe, prompt, config.seed + index))
            name = folder / f"step-{step:08d}-{index}"
            written.append({"step": step, "prompt": prompt, **_save(plan, output, name)})
    finally:
        for component in encoders:
            component.to("cpu")
        denoiser.train(was_training)
        torch.set_rng_state(rng)
    return written


def _save(plan: Any, output: Any, name: Path) -> dict[str, object]:
    """An image as PNG; a clip as MP4 at the family's fps (with its sound, where the pipeline
    renders one), its first frame as a PNG beside it (what the run page and the charts' viewers show)."""
    if plan.window is None:
        path = name.with_suffix(".png")
        output.images[0].save(path)
        return {"path": str(path)}
    from engine.runtime.outputs import clip_frames, pipeline_sound
    from engine.runtime.video_files import write_mp4

    frames = clip_frames(output.frames[0])
    clip = name.with_suffix(".mp4")
    video = plan.family.video_of(plan.base.checkpoint)
    sounds = pipeline_sound(output, None, video.audio_rate) if video is not None and video.audio else []
    write_mp4(frames, round(plan.window.fps), clip, sounds[0] if sounds else None)
    still = name.with_suffix(".png")
    frames[0].save(still)
    return {"path": str(still), "clip": str(clip), "frames": len(frames)}


def _call_kwargs(plan: Any, pipe: Any, prompt: str, seed: int) -> dict[str, Any]:
    checkpoint = plan.base.checkpoint or plan.family.default_checkpoint
    size = plan.config.resolution
    kwargs: dict[str, Any] = {
        "prompt": prompt,
        "num_inference_steps": plan.config.sample_steps,
        "generator": torch.Generator("cpu").manual_seed(seed),
        "height": size,
        "width": size,
        plan.family.pipeline.guidance_kwarg: checkpoint.default_guidance,
    }
    if plan.window is not None:  # a short clip of the window's length, as frames of PIL images
        kwargs.update(num_frames=plan.window.frames, output_type="pil", frame_rate=plan.window.fps)
    accepted = inspect.signature(pipe.__call__).parameters
    return {k: v for k, v in kwargs.items() if k in accepted}
