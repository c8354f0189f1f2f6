"""A clip's shape, decided before anything loads: frames on the lattice, a size the model takes.

Torch-free. A video VAE compresses time by ``frame_step`` after a first frame of
its own, so a frame count off ``k * step + offset`` cannot be encoded (diffusers
rounds it silently; the engine refuses it and names the nearest valid counts).
A size is a multiple of the family's ``size_multiple`` no larger in area than
its largest preset (beyond what it was trained at, clips fall apart). The
OpenAI face speaks seconds: :func:`frames_for_seconds` snaps them onto the
lattice and says it did.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract.types import Checkpoint, FamilySpec, VideoSpec
from engine.errors import EngineError
from engine.policy.video_windows import ClipWindows, InvalidVideoShape, clip_windows




@dataclass(frozen=True)
class VideoShape:
    """A clip's shape as it will render, and the tokens the denoiser sees for it."""

    frames: int
    width: int
    height: int
    fps: int
    #: The latent frames and tokens of one call (a windowed clip's first window).
    latent_frames: int
    tokens: int
    #: A clip longer than one call renders, in windows (:mod:`engine.policy.video_windows`); None: one call.
    windows: ClipWindows | None = None

    @property
    def seconds(self) -> float:
        return self.frames / self.fps

    @property
    def call_frames(self) -> int:
        """The frames one pipeline call renders (what the memory plan is made for)."""
        return self.windows.counts[0] if self.windows is not None else self.frames

    def to_dict(self) -> dict[str, object]:
        windows = {"windows": self.windows.to_dict()} if self.windows is not None else {}
        return {"frames": self.frames, "width": self.width, "height": self.height, "fps": self.fps,
                "seconds": round(self.seconds, 3), "latent_frames": self.latent_frames, "tokens": self.tokens,
                **windows}


def video_spec(family: FamilySpec, checkpoint: Checkpoint | None) -> VideoSpec:
    """The checkpoint's clip rules; a family without any is refused (it renders images)."""
    spec = family.video_of(checkpoint)
    if spec is None or family.rendering.output != "frames":
        raise EngineError(f"{family.label} renders images, not video; generate images with it: drop frames "
                          "and fps (--frames / --fps at the terminal)", code="wrong_output")
    return spec


def check_output(family: FamilySpec, output: str) -> None:
    """Refuse a request through the door that does not serve the family's output kind."""
    if family.rendering.output == output:
        return
    if family.rendering.output == "frames":
        raise EngineError(f"{family.label} renders video: ask for a clip (POST /v1/videos, engine.videos."
                          "generate, or an .mp4 output at the terminal: -o clip.mp4)", code="wrong_output")
    raise EngineError(f"{family.label} renders images, not video: drop frames and fps (--frames / --fps at "
                      "the terminal), or ask for images (POST /v1/images/generations, engine.images.generate)",
                      code="wrong_output")


def presets_text(spec: VideoSpec) -> str:
    return ", ".join(f"{w}x{h}" for w, h in spec.presets)


def video_shape(family: FamilySpec, checkpoint: Checkpoint | None, *, frames: int | None = None,
                width: int | None = None, height: int | None = None, fps: int | None = None,
                window: int | None = None) -> VideoShape:
    """The clip a request renders (its defaults from the checkpoint), or :class:`InvalidVideoShape`.
    A clip longer than the checkpoint's trained window (or ``window`` frames) renders in windows
    where the family can chain them (:func:`~engine.policy.video_windows.clip_windows`)."""
    spec = video_spec(family, checkpoint)
    label = (checkpoint or family.default_checkpoint).label
    count = spec.default_frames if frames is None else frames
    windows = clip_windows(family, checkpoint, spec, count, window)
    if windows is None and not spec.in_range(count):
        nearest = " and ".join(str(n) for n in spec.nearest(count))
        why = (f"its VAE compresses time by {spec.frame_step}, so a frame count must be {spec.lattice}"
               if not spec.on_lattice(count) else f"its clips run {spec.min_frames} to {spec.max_frames} long")
        raise InvalidVideoShape(f"frames={count}: {label} cannot render that clip ({why}); "
                                f"the nearest valid counts are {nearest}")
    if spec.fixed_fps and fps is not None and fps != spec.fps:
        raise InvalidVideoShape(f"fps={fps}: {label} renders at {spec.fps} fps only (its pipeline takes no frame "
                                f"rate, and its sound is timed to it); drop fps (--fps) or pass {spec.fps}")
    default_w, default_h = spec.default_size
    w = width or (default_w if height is None else _other_side(height, spec, default_w, default_h))
    h = height or (default_h if width is None else _other_side(width, spec, default_h, default_w))
    multiple = spec.size_multiple
    if w % multiple or h % multiple:
        raise InvalidVideoShape(f"size {w}x{h}: {label} takes sides in multiples of {multiple} "
                                f"(its presets: {presets_text(spec)})")
    if w * h > spec.max_area:
        raise InvalidVideoShape(f"size {w}x{h} is beyond what {label} was trained at "
                                f"(its presets: {presets_text(spec)}); choose one of them or a smaller size")
    geometry = family.geometry_of(checkpoint)
    latent = spec.latent_frames(windows.counts[0] if windows is not None else count)
    return VideoShape(frames=count, width=w, height=h, fps=fps or spec.fps, latent_frames=latent,
                      tokens=geometry.image_tokens(w, h) * latent, windows=windows)


def _other_side(given: int, spec: VideoSpec, default_this: int, default_given: int) -> int:
    """One side given: the other keeps the default preset's aspect, on the multiple."""
    multiple = spec.size_multiple
    return max(multiple, round(given * default_this / default_given / multiple) * multiple)


@dataclass(frozen=True)
class SnappedFrames:
    """Seconds asked for, as frames on the lattice at the family's fps."""

    frames: int
    asked_frames: float
    fps: int

    @property
    def snapped(self) -> bool:
        return self.frames != self.asked_frames

    def note(self) -> str:
        """What the seconds became: the frames at the fps, and where the lattice moved them."""
        if self.snapped:
            return (f"{self.asked_frames:g} frames at {self.fps} fps snapped to {self.frames} "
                    "(the frame lattice and range)")
        return f"{self.frames} frames at {self.fps} fps (on the frame lattice as asked)"


def frames_for_seconds(family: FamilySpec, checkpoint: Checkpoint | None, seconds: float,
                       fps: int | None = None) -> SnappedFrames:
    """``seconds`` of clip at ``fps`` (the checkpoint's by default), snapped onto the lattice and range."""
    spec = video_spec(family, checkpoint)
    rate = fps or spec.fps
    asked = seconds * rate + (1 if spec.frame_offset else 0)  # n frame intervals hold n + 1 frames
    return SnappedFrames(frames=spec.snap(round(asked)), asked_frames=asked, fps=rate)
