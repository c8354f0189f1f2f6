"""Training clips: probe a video file before a run, and read its window as the trainer trains it.

One module reads clips for both, so the preflight checks exactly what the
trainer will read. Decoding goes through PyAV (its wheels carry ffmpeg).

The probe runs before anything is evicted. A clip is refused, named, when it
is empty (0 bytes or no frames), has no video stream, cannot be opened or
decoded, or is absurd by its header alone: a frame over the pixel cap, or
more frames or seconds than :data:`MAX_CLIP_FRAMES` / :data:`MAX_CLIP_SECONDS`
(refused before a frame is decoded, so a crafted header costs nothing).
Frames are decoded as far as the run's window reaches (the whole clip when
the probe has no window): what lies past it is never trained on.

The window: ``frames`` frames sampled at the family's ``fps`` from the start of
the clip, by each frame's own timestamp (a 30 fps source trained at 16 fps
takes the frame shown at each 1/16 s; a variable frame rate clip, named in the
report, is sampled the same way, by its timestamps, not by frame index). A
clip shorter than the window is refused (``short_clips="refuse"``) or padded
by holding its last frame (``"pad"``); a longer one is cut, with a note. The
display rotation (a phone's portrait clip) is applied to every frame, and the
clip's size is its upright size.

Where the run trains a clip's sound beside its picture (an audio-video family), the
window's sound is read too: the clip's first audio track from its start, resampled to the
family's rate and channels, as long as the window (silence pads a shorter track); a clip
with no audio stream trains the picture alone, and the dataset report names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.requests.references import CLIP_EXTENSIONS

if TYPE_CHECKING:  # numpy and PIL load when a clip is read, not with the preflight
    import numpy as np
    from PIL import Image

#: Header caps, checked before decoding: no training clip is an hour long or 100k frames.
MAX_CLIP_FRAMES = 100_000
MAX_CLIP_SECONDS = 3600.0
#: A clip whose frame intervals differ by more than this ratio has a variable frame rate.
VARIABLE_RATE_RATIO = 1.5


@dataclass(frozen=True)
class ClipWindow:
    """What a run trains of each clip: ``frames`` frames at ``fps``, short clips refused or padded."""

    frames: int
    fps: float
    short: str = "refuse"
    #: The rate a run trains each clip's sound at (its family's), None: the picture alone.
    sound_rate: int | None = None
    #: The channels it trains (the family's: 2 for stereo).
    sound_channels: int = 2

    @property
    def seconds(self) -> float:
        return self.frames / self.fps

    @property
    def sound_samples(self) -> int:
        """Samples per channel of the window's sound (0 where the run trains none)."""
        return round(self.seconds * self.sound_rate) if self.sound_rate else 0

    def to_dict(self) -> dict[str, object]:
        return {"frames": self.frames, "fps": self.fps, "short_clips": self.short,
                "sound_rate": self.sound_rate}


@dataclass(frozen=True)
class ClipInfo:
    """What the probe found: the upright size, the frames decoded and their times."""

    #: (width, height) upright (after the display rotation).
    size: tuple[int, int]
    #: Frames decoded (as far as the window reaches), and the clip's length in seconds.
    frames: int
    seconds: float
    #: The stream's average rate (frames per second), from its header or its timestamps.
    fps: float
    #: Degrees counter-clockwise the frames are turned for display (0, 90, 180, 270).
    rotation: int = 0
    variable_rate: bool = False
    #: Frames the window samples from the clip's own (before padding).
    window_frames: int = 0
    #: Whether the clip has a sound track (an audio stream).
    sound: bool = False


class ClipProblem(Exception):
    """Why a clip cannot be trained on, in words for the dataset report."""


def probe_clip(path: Path, max_pixels: int, window: ClipWindow | None = None) -> ClipInfo:
    """The clip's facts, decoded as far as ``window`` reaches; :class:`ClipProblem` says what is wrong."""
    if path.stat().st_size == 0:
        raise ClipProblem("empty file (0 bytes)")
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ClipProblem("no video stream (an audio-only or data file)")
            stream = container.streams.video[0]
            _check_header(stream, container, max_pixels)
            limit = window.seconds + 1.0 / window.fps if window is not None else None
            sound = bool(container.streams.audio)
            times, rotation, size = _decode(container, stream, limit)
            stated = float(stream.average_rate or 0)  # read while open: a closed container's stream answers nothing
    except ClipProblem:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ClipProblem(f"cannot be decoded as a video ({str(exc).strip()[:200]})") from None
    if sound and window is not None and window.sound_rate:
        try:  # what the trainer will read of its sound, read now: a broken track fails before any eviction
            read_window_sound(path, window)
        except (av.error.FFmpegError, ValueError, IndexError) as exc:
            raise ClipProblem(f"its sound cannot be decoded ({str(exc).strip()[:200]}); remove the track "
                              "or the clip") from None
    if not times:
        raise ClipProblem("no frames (a zero-length clip)")
    rate = _rate(stated, times)
    seconds = _length(times, rate)
    upright = size if rotation % 180 == 0 else (size[1], size[0])
    return ClipInfo(
        size=upright, frames=len(times), seconds=seconds, fps=rate, rotation=rotation,
        variable_rate=_variable(times),
        window_frames=min(window.frames, _samples(seconds, window.fps)) if window is not None else 0,
        sound=sound,
    )


def _check_header(stream: Any, container: Any, max_pixels: int) -> None:
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    if width * height > max_pixels:
        raise ClipProblem(f"absurd size: {width}x{height} frames are over the {max_pixels:,}-pixel limit")
    if int(stream.frames or 0) > MAX_CLIP_FRAMES:
        raise ClipProblem(f"absurd length: its header says {stream.frames:,} frames (the limit is {MAX_CLIP_FRAMES:,})")
    seconds = _header_seconds(stream, container)
    if seconds is not None and seconds > MAX_CLIP_SECONDS:
        raise ClipProblem(f"absurd length: its header says {seconds:,.0f} s (the limit is {MAX_CLIP_SECONDS:,.0f} s)")


def _header_seconds(stream: Any, container: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    return None


def _decode(container: Any, stream: Any, limit: float | None) -> tuple[list[float], int, tuple[int, int]]:
    """Each decoded frame's time, the display rotation and the coded size; stops past ``limit`` s."""
    times: list[float] = []
    rotation, size = 0, (0, 0)
    start: float | None = None
    for frame in container.decode(stream):
        time = float(frame.time) if frame.time is not None else len(times) / float(stream.average_rate or 1)
        start = time if start is None else start
        if not times:
            rotation, size = _rotation(frame), (frame.width, frame.height)
        times.append(time - start)
        if len(times) > MAX_CLIP_FRAMES:
            raise ClipProblem(f"absurd length: over {MAX_CLIP_FRAMES:,} frames")
        if limit is not None and times[-1] >= limit:
            break
    return times, rotation, size


def _rotation(frame: Any) -> int:
    """The display rotation in whole quarter turns, counter-clockwise degrees."""
    angle = getattr(frame, "rotation", 0) or 0
    return int(round(float(angle) / 90.0)) * 90 % 360


def _rate(stated: float, times: list[float]) -> float:
    """The header's average rate, else the decoded times' own."""
    rate = stated
    if rate <= 0 and len(times) > 1 and times[-1] > 0:
        rate = (len(times) - 1) / times[-1]
    return rate or 1.0


def _length(times: list[float], rate: float) -> float:
    """The clip's length: its last frame's time plus one frame."""
    return times[-1] + 1.0 / rate


def _variable(times: list[float]) -> bool:
    steps = [b - a for a, b in zip(times, times[1:]) if b > a]
    return len(steps) > 1 and max(steps) / min(steps) > VARIABLE_RATE_RATIO


def _samples(seconds: float, fps: float) -> int:
    """Window frames a clip of ``seconds`` holds at ``fps`` (the times ``i / fps`` inside it)."""
    return max(1, math.ceil(seconds * fps - 1e-6))


def read_window(path: Path, window: ClipWindow) -> list[Image.Image]:
    """The window's frames, upright RGB: ``window.frames`` of them, sampled by timestamp at
    ``window.fps``; a short clip's last frame is held (``pad``; the preflight refused it otherwise)."""
    import av

    wanted = [index / window.fps for index in range(window.frames)]
    picked: list[Image.Image] = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        start: float | None = None
        previous: Image.Image | None = None  # the frame on screen until this one, upright (converted once)
        time = 0.0
        for frame in container.decode(stream):
            time = float(frame.time) if frame.time is not None else 0.0
            start = time if start is None else start
            time -= start
            # Every wanted time before this frame shows the previous frame.
            while previous is not None and len(picked) < len(wanted) and wanted[len(picked)] < time - 1e-6:
                picked.append(previous)
            if len(picked) == len(wanted):
                break
            previous = _upright(frame)
        if previous is not None and len(picked) < len(wanted):
            length = time + 1.0 / float(stream.average_rate or window.fps)
            while len(picked) < len(wanted) and wanted[len(picked)] < length - 1e-6:
                picked.append(previous)
    if not picked:
        raise ClipProblem("no frames (a zero-length clip)")
    while len(picked) < len(wanted):
        picked.append(picked[-1])  # pad: hold the last frame
    return picked


def read_window_sound(path: Path, window: ClipWindow) -> np.ndarray | None:
    """The window's sound as the run trains it: ``(window.sound_channels, window.sound_samples)``
    float32 in [-1, 1], resampled to ``window.sound_rate`` (PyAV's resampler: libswresample) from the
    clip's start, a track shorter than the window padded with silence; None where the clip has no
    sound or the run trains none."""
    import av

    if not window.sound_rate:
        return None
    wanted = window.sound_samples
    layout = "stereo" if window.sound_channels == 2 else "mono"
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=window.sound_rate)
    import numpy as np

    chunks: list[np.ndarray] = []
    taken = 0
    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        for frame in container.decode(container.streams.audio[0]):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray())
                taken += chunks[-1].shape[1]
            if taken >= wanted:
                break
        else:
            chunks += [out.to_ndarray() for out in resampler.resample(None)]  # what the resampler holds back
    samples = np.concatenate(chunks, axis=1) if chunks else np.zeros((window.sound_channels, 0), np.float32)
    track: np.ndarray = np.zeros((window.sound_channels, wanted), dtype=np.float32)
    kept = min(wanted, samples.shape[1])
    track[:, :kept] = np.clip(samples[:, :kept], -1.0, 1.0)
    return track


def first_frame(path: Path) -> Image.Image:
    """The clip's first frame, upright (the dataset manager's thumbnail)."""
    return read_window(path, ClipWindow(frames=1, fps=1.0))[0]


def clip_header(path: Path) -> tuple[int, int, float | None]:
    """Upright width, height and the header's seconds, without decoding (the dataset listing);
    :class:`ClipProblem` where the container or its video stream cannot be read."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ClipProblem("no video stream (an audio-only or data file)")
            stream = container.streams.video[0]
            width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
            seconds = _header_seconds(stream, container)
    except av.error.FFmpegError as exc:
        raise ClipProblem(f"cannot be read as a video ({str(exc).strip()[:200]})") from None
    return width, height, seconds


def _upright(frame: Any) -> Image.Image:
    image = frame.to_image().convert("RGB")
    rotation = _rotation(frame)
    return image.rotate(rotation, expand=True) if rotation else image


__all__ = ["CLIP_EXTENSIONS", "ClipInfo", "ClipProblem", "ClipWindow", "clip_header", "first_frame", "probe_clip",
           "read_window", "read_window_sound"]
