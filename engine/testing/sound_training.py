"""How well a trained LoRA predicts a training clip's picture and sound, under fixed noise.

A run's per-step loss is drawn at a new sigma each step; this holds the draw still: the clip's
window (picture and sound, read and encoded as the run read them) noised once with a fixed
generator at one sigma each, and the family runtime's ``predict_with_sound`` asked for both
velocities, by the base and then with the run's LoRA. A LoRA that learned the clip predicts
both closer to the truth. And the check that a LoRA moves a generated clip's picture and sound
(scale 0 the base's). Used by the sound families' tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.contract.family_runtime import load_runtime
from engine.preflight.clips import read_window_sound
from engine.runtime.modular import open_pipeline
from engine.training.buckets import fit
from engine.training.inputs import load_clip
from engine.training.preflight import TrainingPlan


@dataclass(frozen=True)
class Errors:
    """Mean squared error of the picture's and the sound's velocity."""

    picture: float
    sound: float


def base_and_trained(plan: TrainingPlan, lora: Path, clip: str, prompt: str, sigma: float = 0.5,
                     sound_sigma: float | None = None) -> tuple[Errors, Errors]:
    """The base's errors on ``clip`` (a relative name in the run's dataset), then the LoRA's."""
    assert plan.window is not None, "a clip run"
    runtime = load_runtime(plan.family)
    pipe = open_pipeline(Path(plan.base.location), plan.family)
    item = next(item for item in plan.dataset.items if item.relative == clip)
    size = plan.config.resolution
    x0 = runtime.encode_images(pipe, load_clip(item.image, fit(item.size, (size, size)), plan.window))
    samples = read_window_sound(item.image, plan.window)
    assert samples is not None, f"{clip} has no sound"
    s0 = runtime.encode_sound(pipe, torch.from_numpy(samples))[None]
    cond = runtime.encode_prompts(pipe, [prompt], torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    noise, sound_noise = torch.randn(x0.shape, generator=generator), torch.randn(s0.shape, generator=generator)
    s, t = sigma, sound_sigma if sound_sigma is not None else sigma
    noisy, noisy_sound = (1 - s) * x0 + s * noise, (1 - t) * s0 + t * sound_noise

    def errors() -> Errors:
        with torch.no_grad():
            video, sound = runtime.predict_with_sound(pipe, pipe.transformer, noisy, noisy_sound, torch.tensor([s]),
                                                      torch.tensor([t]), cond)
        return Errors(float((video - (noise - x0)).pow(2).mean()), float((sound - (sound_noise - s0)).pow(2).mean()))

    base = errors()
    pipe.load_lora_weights(str(lora), adapter_name="trained")
    return base, errors()


def check_lora_moves_clip(registry: Any, asked: dict[str, Any], lora: Path) -> None:
    """Through the engine's LoRA door: ``lora`` at scale 1 moves the clip ``asked`` renders, its
    picture and its sound; at scale 0 the clip is the base's, frame for frame and sample for sample."""
    import numpy as np

    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.service.facade import Engine

    with Engine(registry=registry, hardware=probe(verify=False)) as engine:
        base = engine.videos.generate(GenerateBody(**asked))
        moved = engine.videos.generate(GenerateBody(**asked), loras=[f"{lora}:1.0"])
        zero = engine.videos.generate(GenerateBody(**asked), loras=[f"{lora}:0.0"])
    assert base.sound is not None and moved.sound is not None and zero.sound is not None, "a clip lost its sound"
    assert [f.tobytes() for f in moved.frames] != [f.tobytes() for f in base.frames], "the LoRA left the picture"
    assert not np.allclose(moved.sound.samples, base.sound.samples, atol=1e-4), "the LoRA left the sound"
    assert [f.tobytes() for f in zero.frames] == [f.tobytes() for f in base.frames], "scale 0 moved the picture"
    assert np.allclose(zero.sound.samples, base.sound.samples, atol=1e-6), "scale 0 moved the sound"
