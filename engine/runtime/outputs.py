"""Reading what a diffusers pipeline call returned, as the family's output kind says.

Image pipelines return ``.images`` (PIL with the default ``output_type``); video
pipelines return ``.frames``: per prompt, a list of PIL frames (``output_type="pil"``,
which the engine asks for) or an array ``[frames, H, W, 3]`` in 0-1 (their default
``np``). Either way a clip comes back as a list of RGB PIL images.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

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
