"""What a plan sizes its activations for: the request's image or clip, else the model's own size. Pure."""

from __future__ import annotations

from engine.contract.types import Checkpoint, FamilySpec
from engine.policy.activations import DEFAULT_SIDE_PX, ImageShape
from engine.policy.plan import ModelDefaults
from engine.requests.inference import InferenceRequest


def own_size(defaults: ModelDefaults) -> tuple[int, int] | None:
    """The model's own (width, height), where its folder gives both."""
    return (defaults.width, defaults.height) if defaults.width and defaults.height else None


def request_shape(family: FamilySpec, checkpoint: Checkpoint | None, request: InferenceRequest,
                  own: tuple[int, int] | None = None, own_frames: int | None = None) -> ImageShape:
    """What the guard sizes for: the request's size and batch (the model's own size, else the
    family's native side, else 1024 px, by default), and for a video family its clip (the model's own clip, else the
    checkpoint's default preset and frames, where the request is silent)."""
    video = family.video_of(checkpoint) if family.rendering.output == "frames" else None
    if video is None:
        side = family.rendering.native_side or DEFAULT_SIDE_PX  # a 2K-native pipeline's own 2048
        width, height = own or (side, side)
        return ImageShape(request.width or width, request.height or height, request.count)
    width, height = own or video.default_size
    return ImageShape(request.width or width, request.height or height, request.count,
                      frames=request.frames or own_frames or video.default_frames)
