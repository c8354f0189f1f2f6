"""Reading what a diffusers pipeline call returned, as the family's output kind says.

Image pipelines return ``.images`` (PIL with the default ``output_type``); video
pipelines return ``.frames``: per prompt, a list of PIL frames (``output_type="pil"``,
which the engine asks for) or an array ``[frames, H, W, 3]`` in 0-1 (their default
``np``). Either way a clip comes back as a list of RGB PIL images. An audio-video
pipeline's ``.audio`` becomes each clip's :class:`~engine.contract.sound.Sound`, carried on
the clip (:class:`Clip`, still a list of frames).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from PIL import Image

from engine.contract.sound import Sound
from engine.errors import EngineError


def pipeline_output(kind: str, result: Any) -> list[Any]:
    """One entry per prompt: an image (``images``) or a clip's frames (``frames``)."""
    if kind == "frames":
        frames = getattr(result, "frames", None)
        if frames is None:
            raise EngineError(f"the pipeline returned {type(result).__name__}, which has no frames",
                              code="unreadable_output")
        return [clip_frames(clip) for clip in frames]
    images = getattr(result, "images", None)
    if images is None:
        raise EngineError(
            f"the pipeline returned {type(result).__name__}, which has no images; a video family's "
            "table says output='frames'", code="unreadable_output",
        )
    return list(images)


def clip_frames(clip: Any) -> list[Image.Image]:
    """A clip's frames as RGB PIL images: from PIL frames, or an array / tensor in 0-1."""
    if isinstance(clip, (list, tuple)) and clip and isinstance(clip[0], Image.Image):
        return [frame.convert("RGB") for frame in clip]
    array = clip.detach().float().cpu().numpy() if hasattr(clip, "detach") else np.asarray(clip)
    if array.ndim == 4 and array.shape[-1] not in (1, 3) and array.shape[1] in (1, 3):
        array = array.transpose(0, 2, 3, 1)  # [frames, C, H, W] -> [frames, H, W, C]
    pixels = (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return [Image.fromarray(frame).convert("RGB") for frame in pixels]


class Clip(list):  # type: ignore[type-arg]
    """A clip's frames (a list of PIL images, as every session returns a clip), with the sound
    its family rendered beside them (None for a silent family)."""

    sound: Sound | None = None


def with_sound(clips: list[Any], sounds: list[Sound | None]) -> list[Any]:
    """Each clip's frames as a :class:`Clip` carrying its sound, in order."""
    paired = []
    for frames, sound in itertools.zip_longest(clips, sounds[:len(clips)]):
        clip = Clip(frames)
        clip.sound = sound
        paired.append(clip)
    return paired


def pipeline_sound(result: Any, pipeline: Any, rate: int | None) -> list[Sound | None]:
    """Each clip's sound from ``result.audio`` (``(batch, channels, samples)``, or one clip's
    ``(channels, samples)``), at ``rate`` or the pipeline's vocoder rate; [] where it has none."""
    audio = getattr(result, "audio", None)
    if audio is None:
        return []
    array = audio.detach().float().cpu().numpy() if hasattr(audio, "detach") else np.asarray(audio, dtype=np.float32)
    if array.ndim == 2:
        array = array[None]
    vocoder = getattr(pipeline, "vocoder", None)
    rate = rate or int(getattr(getattr(vocoder, "config", None), "output_sampling_rate", 0) or 0)
    if not rate:
        raise EngineError("the pipeline gave sound without a sample rate: set VideoSpec.audio_rate in the family's "
                          "table", code="unreadable_output")
    return [Sound(np.clip(track, -1.0, 1.0).astype(np.float32), rate) for track in array]
