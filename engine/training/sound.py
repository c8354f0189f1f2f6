"""A clip's sound trained beside its picture (an audio-video family's ``TrainingSpec.sound``).

Each clip's window of sound (:func:`engine.preflight.clips.read_window_sound`: resampled to
the family's rate, as long as the picture's window) is encoded once, beside its latents, by
the runtime module's ``encode_sound``. A step noises it at the picture's drawn time mapped
onto the sound's own schedule (the draw unshifted by the picture's flow shift and shifted by
the sound's), each example's noise from that example's generator after its picture's, so a
resume and any split over ranks draw the same. A clip with no sound (and a still) is fed
pure noise at sigma 1, the sound the model is asked to make up, and adds nothing to the
sound's loss: it trains the picture alone. The step's loss is the picture's plus the
family's weight times the sound's, both reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from engine.contract.types import SoundTraining
from engine.preflight.clips import read_window_sound
from engine.training import levers
from engine.training.preflight import TrainingPlan


@dataclass(frozen=True)
class SoundInputs:
    """Each item's sound latents (None: none heard), the latents of silence (a silent
    clip's shape), and how the family trains them."""

    tracks: list[torch.Tensor | None]
    silence: torch.Tensor
    spec: SoundTraining


@dataclass(frozen=True)
class SoundBatch:
    """One micro-batch's sound, noised: what the model is given and what it should say."""

    noisy: torch.Tensor
    sigmas: torch.Tensor
    target: torch.Tensor
    heard: torch.Tensor


def cache_sounds(plan: TrainingPlan, pipe: Any, runtime: ModuleType, device: torch.device, dtype: torch.dtype,
                 between: Callable[[], None]) -> SoundInputs | None:
    """Every item's sound latents, encoded once (None where the family trains no sound)."""
    spec = plan.family.training.sound if plan.family.training is not None else None
    window = plan.window
    if spec is None or window is None or not window.sound_rate:
        return None

    def encoded(samples: Any) -> torch.Tensor:
        return runtime.encode_sound(pipe, torch.as_tensor(samples).to(device, dtype)).to("cpu")

    tracks: list[torch.Tensor | None] = []
    for item in plan.dataset.items:
        between()
        samples = read_window_sound(item.image, window) if item.is_clip else None
        tracks.append(None if samples is None else encoded(samples))
    # A silent item's latents are zeros of a track's shape: a heard one's (every window is as
    # long), else silence encoded once for its shape (stills and silent clips alone).
    shaped = next((track for track in tracks if track is not None), None)
    if shaped is None:
        shaped = encoded(torch.zeros(window.sound_channels, window.sound_samples))
    return SoundInputs(tracks, torch.zeros_like(shaped), spec)


def noised(inputs: SoundInputs, images: list[int], draws: list[torch.Generator], sigmas: torch.Tensor,
           picture_shift: float | None) -> SoundBatch:
    """The batch's sound noised at the picture's ``sigmas`` mapped onto the sound's schedule;
    a silent example's sound is pure noise (sigma 1)."""
    x0 = torch.stack([inputs.tracks[i] if inputs.tracks[i] is not None else inputs.silence for i in images])
    heard = torch.tensor([inputs.tracks[i] is not None for i in images])
    noise = torch.empty_like(x0)
    for row, generator in zip(noise, draws, strict=True):
        torch.randn(row.shape, generator=generator, out=row)
    own = levers.shift_sigmas(_unshifted(sigmas.float().cpu(), picture_shift), inputs.spec.flow_shift)
    own = torch.where(heard, own, torch.ones_like(own))
    s = own.view(-1, *([1] * (x0.dim() - 1)))
    return SoundBatch(noisy=(1 - s) * x0 + s * noise, sigmas=own, target=noise - x0, heard=heard)


def _unshifted(sigmas: torch.Tensor, shift: float | None) -> torch.Tensor:
    """The draw before ``levers.shift_sigmas`` shifted it (its inverse)."""
    if shift is None or shift == 1.0:
        return sigmas
    return sigmas / (shift - (shift - 1) * sigmas)


def sound_loss(batch: SoundBatch, prediction: torch.Tensor, weighting: str, prediction_type: str) -> torch.Tensor:
    """The heard examples' weighted MSE (0 when none in the batch has sound)."""
    heard = batch.heard.to(prediction.device)
    if not bool(heard.any()):
        return prediction.sum() * 0.0  # keeps the graph whole: a batch of silent clips
    target = batch.target.to(prediction.device, prediction.dtype)
    return levers.weighted_mse(prediction[heard], target[heard], weighting, prediction_type,
                               batch.sigmas.to(prediction.device)[heard])


def reported(parts: dict[str, float]) -> dict[str, float]:
    """A step's per-modality losses as its progress event says them: the picture's, and the
    sound's over the examples heard (left out of a step that heard none)."""
    heard = parts.pop("heard", 0.0)
    summed = parts.pop("loss_sound", 0.0)
    return {**parts, **({"loss_sound": summed / heard} if heard else {})}


def step_loss(run: Any, inputs: SoundInputs, picture: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              cond: dict[str, torch.Tensor], images: list[int], draws: list[torch.Generator],
              how: tuple[str, str]) -> tuple[torch.Tensor, dict[str, float]]:
    """The picture's loss plus the weighted sound's, from one call of the runtime's
    ``predict_with_sound``; both reported (the sound's summed over the examples heard, with
    their count, so a step's report divides once: :func:`reported`)."""
    noisy, sigmas, target = picture
    weighting, kind = how
    batch = noised(inputs, images, draws, sigmas, run.chosen.flow_shift.value)
    video_prediction, sound_prediction = run.runtime.predict_with_sound(
        run.pipe, run.forward, noisy, batch.noisy.to(noisy.device, noisy.dtype), sigmas,
        batch.sigmas.to(noisy.device), cond)
    video = levers.weighted_mse(video_prediction, target, weighting, kind, sigmas)
    audio = sound_loss(batch, sound_prediction, weighting, kind)
    heard = float(batch.heard.sum())
    return video + inputs.spec.loss_weight * audio, {"loss_video": video.item(), "loss_sound": audio.item() * heard,
                                                      "heard": heard}
