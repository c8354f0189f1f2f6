"""Clips longer than a checkpoint renders at once: windows, each conditioned on the last frame before it.

A video checkpoint is trained on clips up to its ``max_frames`` (81 or
121); past that its motion loops or falls apart. A longer clip is rendered window by window,
the way the field chains them: each window after the first is an image-to-video call whose
first frame is the previous window's last, and the two copies of that frame are blended,
so the clip runs on without a cut. The memory plan is one window's; the steps, progress and
a cancel run over the whole clip.

Where the family's checkpoint has no image-to-video workflow (nothing to condition a window
on), or the clip carries sound (its track would restart at each window), a long clip is
refused with the reason. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract.types import Checkpoint, FamilySpec
from engine.contract.video_spec import VideoSpec
from engine.errors import EngineError

__all__ = ["ClipWindows", "InvalidVideoShape", "clip_windows"]

#: Frames two neighbouring windows share (the earlier one's last, the later one's first).
OVERLAP = 1


class InvalidVideoShape(EngineError):
    """A frame count or size the family's VAE and denoiser cannot take (:mod:`engine.policy.video`'s
    refusal, defined here where the windows' refusals need it too)."""

    code = "invalid_video_shape"
    http_status = 422


@dataclass(frozen=True)
class ClipWindows:
    """A clip of ``frames`` rendered as windows of ``counts`` frames, each after the first
    conditioned on the frame before it (``OVERLAP`` frame shared and blended)."""

    frames: int
    counts: tuple[int, ...]
    #: Why windows, said in the plan and the recipe.
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"frames": self.frames, "windows": list(self.counts), "overlap": OVERLAP,
                "how": "last-frame conditioning (image to video)", "reason": self.reason}


def clip_windows(family: FamilySpec, checkpoint: Checkpoint | None, spec: VideoSpec, frames: int,
                 window: int | None = None) -> ClipWindows | None:
    """The windows a clip of ``frames`` renders in: None where one call renders it (``frames``
    within ``window``, default the checkpoint's trained ``max_frames``).

    :raises EngineError: ``invalid_video_shape`` where the clip is longer than one window and the
        family cannot chain windows, or ``window`` is not a frame count it renders.
    """
    label = (checkpoint or family.default_checkpoint).label
    trained = spec.max_frames
    size = trained if window is None else window
    if window is not None and not (spec.in_range(window) and window > spec.frame_step):
        raise InvalidVideoShape(f"window_frames={window}: {label} renders windows of {spec.lattice} frames, "
                     f"{spec.frame_step + spec.frame_offset} to {trained}")
    if frames <= size or not spec.on_lattice(frames):
        return None  # one call (or the shape gate's own refusal, which names the lattice)
    if "img2vid" not in family.workflows_of(checkpoint):
        raise InvalidVideoShape(f"frames={frames}: {label} renders at most {trained} frames at once and has no image-to-video "
                     f"workflow to continue a clip from its last frame; ask for {trained} frames or fewer, or use "
                     "a checkpoint that takes an image")
    if spec.audio:
        raise InvalidVideoShape(f"frames={frames}: {label} renders at most {trained} frames at once, and its sound cannot be "
                     f"carried from one window to the next yet; ask for {trained} frames or fewer")
    counts = [size]
    left = frames - size
    while left > 0:
        count = min(size, left + OVERLAP)
        counts.append(count)
        left -= count - OVERLAP
    why = (f"{frames} frames are more than {label}'s {trained}-frame trained window" if window is None
           else f"windows of {window} frames asked")
    reason = (f"{why}: {len(counts)} windows ({', '.join(map(str, counts))} frames), each after the first "
              "conditioned on the last frame before it, that frame blended across the seam")
    return ClipWindows(frames=frames, counts=tuple(counts), reason=reason)
