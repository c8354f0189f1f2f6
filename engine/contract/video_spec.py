"""A video family's clips: the output kind, and :class:`VideoSpec` (lattice, fps, sizes).

Split from :mod:`engine.contract.family_sections` (which still names them) when the
training window joined it; named from :mod:`engine.contract.types` like every type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.contract.video_memory import VideoMemory


#: What a family's pipeline call gives back: still images, or the frames of a clip (at an fps).
OutputKind = Literal["images", "frames"]
OUTPUT_KINDS: tuple[str, ...] = ("images", "frames")


@dataclass(frozen=True)
class CallShape:
    """The shape one pipeline call renders, as the request decided it (plugin API 2): what
    ``engine_generate_kwargs`` is given beside the engine's arguments, so a family whose
    pipeline spells them its own way (``frame_rate``, ``num_frames``) can pass them on.
    ``frames`` and ``fps`` are None for images; a side is None where the model's default rules."""

    width: int | None
    height: int | None
    count: int = 1
    frames: int | None = None
    fps: int | None = None


@dataclass(frozen=True)
class VideoSpec:
    """The clips a video family renders: its frame lattice, fps and sizes.

    A video VAE compresses time by ``frame_step`` after a first frame of its
    own, so a valid frame count is ``k * frame_step + frame_offset`` (4k+1 for
    the served video VAEs) between ``min_frames`` and ``max_frames``. Sizes are
    multiples of ``size_multiple`` (the VAE's stride x the patch) no larger in
    area than the largest preset; ``presets`` are the ``(width, height)`` the
    checkpoint was trained at, the first the default. A checkpoint may carry
    its own (:attr:`~engine.contract.types.Checkpoint.video`).
    """

    #: Frames per second the checkpoint was trained at (a clip is stamped with it by default).
    fps: int
    #: The clip a request that names no frame count renders (on the lattice).
    default_frames: int
    #: ``(width, height)`` sizes it was trained at, the default first; the largest bounds a size's area.
    presets: tuple[tuple[int, int], ...]
    #: The lattice ``k * frame_step + frame_offset``: the VAE's temporal stride...
    frame_step: int = 4
    #: ... and the frames before it (1: the VAE's first frame stands alone).
    frame_offset: int = 1
    #: The fewest frames a clip may have (on the lattice).
    min_frames: int = 1
    #: The most (on the lattice).
    max_frames: int = 121
    #: Sides are multiples of this (the VAE's stride x the patch).
    size_multiple: int = 16
    #: Whether the clip carries sound: the pipeline renders an audio track beside the frames,
    #: read per clip (``engine_pipeline_sound``) and muxed into the MP4 as AAC.
    audio: bool = False
    #: The track's sample rate (its vocoder's output rate), which the contract kit checks the MP4
    #: against; None: whatever the pipeline gives. (Plugin API 2.)
    audio_rate: int | None = None
    #: Latent frames each ``frame_step`` of frames becomes (1 for most video VAEs; one that
    #: encodes 17 frames into 5 latents has 5) ... (Plugin API 2.)
    latents_per_step: int = 1
    #: ... and the latent frames of the ``frame_offset`` frames (None: 1 where there are any).
    first_latents: int | None = None
    #: The model renders at ``fps`` alone (its pipeline takes no frame rate, and its sound is
    #: timed to it): a request for another fps is refused before anything loads. (Plugin API 2.)
    fixed_fps: bool = False
    #: What a clip holds at its peak (:class:`VideoMemory`); None: the plan's generic rule.
    memory: VideoMemory | None = None
    #: Frames a LoRA run trains each clip at when the request names none (on the lattice;
    #: None: ``default_frames``). Shorter than a render: a window of the motion, at far less memory.
    training_frames: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "presets", tuple((int(w), int(h)) for w, h in self.presets))
        if not self.presets:
            raise ValueError("VideoSpec.presets needs at least one (width, height)")
        for name in ("fps", "frame_step", "size_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"VideoSpec.{name} must be at least 1")
        named = (self.min_frames, self.max_frames, self.default_frames)
        for frames in (*named, *(() if self.training_frames is None else (self.training_frames,))):
            if not self.on_lattice(frames):
                raise ValueError(f"VideoSpec frame count {frames} is not {self.lattice}")

    @property
    def lattice(self) -> str:
        """The rule as people write it: ``4k+1``."""
        return f"{self.frame_step}k+{self.frame_offset}" if self.frame_offset else f"{self.frame_step}k"

    @property
    def default_size(self) -> tuple[int, int]:
        return self.presets[0]

    @property
    def max_area(self) -> int:
        return max(w * h for w, h in self.presets)

    def on_lattice(self, frames: int) -> bool:
        """Whether ``frames`` is ``k * step + offset`` for a whole ``k`` >= 0."""
        return frames >= self.frame_offset and (frames - self.frame_offset) % self.frame_step == 0

    def in_range(self, frames: int) -> bool:
        return self.min_frames <= frames <= self.max_frames and self.on_lattice(frames)

    def nearest(self, frames: int) -> tuple[int, ...]:
        """The valid counts either side of ``frames`` (one where it is at an end or on the lattice)."""
        below = self.frame_offset + max(0, (frames - self.frame_offset) // self.frame_step) * self.frame_step
        candidates = {min(max(value, self.min_frames), self.max_frames) for value in (below, below + self.frame_step)}
        return tuple(sorted(candidates))

    def snap(self, frames: int) -> int:
        """The valid count nearest ``frames`` (the lower one on a tie)."""
        return min(self.nearest(frames), key=lambda value: (abs(value - frames), value))

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames``: the first, then ``latents_per_step`` per ``frame_step``."""
        first = self.first_latents if self.first_latents is not None else (1 if self.frame_offset else 0)
        return (frames - self.frame_offset) // self.frame_step * self.latents_per_step + first
