"""The arguments of one pipeline call that come from the request and the checkpoint alone: the
guidance (asked, a few-step LoRA's, the checkpoint's), a distilled checkpoint's sigmas, a clip's
frames, fps and second-expert guidance, and the shape the call renders."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.contract.video_spec import CallShape

if TYPE_CHECKING:
    from engine.runtime.generation import GenerateRequest


def guidance_of(request: GenerateRequest, checkpoint: Any, sampling: Any) -> float:
    """The request's guidance, else a few-step LoRA's, else the checkpoint's."""
    if request.guidance is not None:
        return float(request.guidance)
    return float(sampling.guidance if sampling is not None and sampling.guidance is not None
                 else checkpoint.default_guidance)


def schedule_of(checkpoint: Any) -> list[float] | None:
    """A distilled checkpoint's own sigmas (their count is the step count, checked before the
    call); None: the scheduler's schedule."""
    return list(checkpoint.sigmas) or None


def call_shape(request: GenerateRequest, video: Any, width: int | None, height: int | None,
               count: int) -> CallShape:
    """The request's shape as the call renders it: a clip's frames and fps (the checkpoint's
    fps where the request gave none), the size, the images in this call."""
    fps = request.fps or (video.fps if video is not None else None)
    return CallShape(width=width or None, height=height or None, count=count,
                     frames=request.frames if video is not None else None, fps=fps)


def clip_kwargs(request: GenerateRequest, checkpoint: Any, video: Any, sampling: Any = None) -> dict[str, Any]:
    """A video call's own arguments: the frame count (checked on the lattice before the
    call), the fps where the pipeline takes one (``frame_rate``: an audio-video pipeline's also sets its sound's
    length), PIL frames out, one clip per prompt, and a second expert's guidance."""
    kwargs: dict[str, Any] = {
        "num_frames": request.frames or video.default_frames, "frame_rate": float(request.fps or video.fps),
        "output_type": "pil", "num_videos_per_prompt": 1,
    }
    second = request.guidance_2 if request.guidance_2 is not None else checkpoint.expert_guidance
    if request.guidance_2 is None and second is not None and sampling is not None and sampling.guidance is not None:
        second = sampling.guidance  # a few-step LoRA pair samples both experts at its guidance
    if second is not None:
        kwargs["guidance_scale_2"] = second
    return kwargs
