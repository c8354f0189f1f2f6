"""Small real image and clip datasets on disk, for tests, demos and benchmarks (the images'
writer is the service's, behind ``tiny dataset``: :mod:`engine.service.tiny_dataset`)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

from engine.service.tiny_dataset import CAPTIONS, write_dataset

__all__ = ["CAPTIONS", "write_clip", "write_clip_dataset", "write_dataset"]


def write_clip(path: Path, frames: int = 9, size: tuple[int, int] = (64, 64), fps: int = 16, *,
               index: int = 0, rotation: int | None = None, tone_hz: float | None = None) -> Path:
    """A real H.264 clip through PyAV: a square sliding across a coloured field (motion to learn).

    ``rotation``: a display rotation (counter-clockwise degrees) stored in the stream, as a phone's
    portrait clip carries one. ``tone_hz``: a sound track too (AAC, 44.1 kHz stereo, as cameras
    record): a tone at that pitch whose loudness follows the square, as long as the picture.
    """
    from fractions import Fraction

    import av

    width, height = size
    if tone_hz is not None:
        return _write_clip_with_sound(path, frames, size, fps, index, tone_hz)
    container_format = "avi" if Path(path).suffix.lower() == ".avi" else "mp4"  # an .avi clip, as cameras write
    with av.open(str(path), mode="w", format=container_format) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for number in range(frames):
            for packet in stream.encode(av.VideoFrame.from_image(_frame(size, frames, number, index))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _frame(size: tuple[int, int], frames: int, number: int, index: int) -> Image.Image:
    """Frame ``number`` of clip ``index``: the square ``number`` steps along."""
    width, height = size
    image = Image.new("RGB", size, ((index * 70) % 256, 90, 200 - index * 30 % 200))
    side = min(width, height) // 3
    left = (number * max(1, (width - side) // max(1, frames - 1))) % max(1, width - side)
    ImageDraw.Draw(image).rectangle((left, height // 3, left + side, height // 3 + side), fill=(240, 230, 40))
    return image


#: The rate a test clip's sound is recorded at (a camera's; a family trains it at its own).
CLIP_SOUND_RATE = 44100


def _write_clip_with_sound(path: Path, frames: int, size: tuple[int, int], fps: int, index: int,
                           tone_hz: float) -> Path:
    import numpy as np

    from engine.contract.sound import Sound
    from engine.runtime.video_files import write_mp4

    seconds = frames / fps
    times = np.arange(round(seconds * CLIP_SOUND_RATE)) / CLIP_SOUND_RATE
    loudness = 0.2 + 0.6 * times / seconds  # grows as the square crosses
    tone = (loudness * np.sin(2 * np.pi * tone_hz * times)).astype(np.float32)
    sound = Sound(np.stack([tone, tone[::-1].copy()]), CLIP_SOUND_RATE)
    write_mp4([_frame(size, frames, number, index) for number in range(frames)], fps, path, sound)
    return path


def write_clip_dataset(folder: Path, clips: int = 2, images: int = 1, *, frames: int = 9, size: int = 64,
                       fps: int = 16, tone_hz: float | None = None) -> Path:
    """``clips`` real MP4 clips and ``images`` PNGs side by side, each with a ``.txt`` caption
    (``tone_hz``: each clip with a sound track, its tone an octave apart from the last's)."""
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(clips):
        clip = write_clip(folder / f"clip_{index:03d}.mp4", frames, (size, size), fps, index=index,
                          tone_hz=tone_hz * 2 ** index if tone_hz is not None else None)
        clip.with_suffix(".txt").write_text(f"a yellow square sliding, {CAPTIONS[index % len(CAPTIONS)]}",
                                            encoding="utf-8")
    if images:
        write_dataset(folder / "stills", count=images, size=size)
    return folder
