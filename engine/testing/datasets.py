"""Small real image and clip datasets on disk, for tests, demos and benchmarks (the images'
writer is the service's, behind ``tiny dataset``: :mod:`engine.service.tiny_dataset`)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

from engine.service.tiny_dataset import CAPTIONS, write_dataset

__all__ = ["CAPTIONS", "write_clip", "write_clip_dataset", "write_dataset"]


def write_clip(path: Path, frames: int = 9, size: tuple[int, int] = (64, 64), fps: int = 16, *,
               index: int = 0, rotation: int | None = None) -> Path:
    """A real H.264 clip through PyAV: a square sliding across a coloured field (motion to learn).

    ``rotation``: a display rotation (counter-clockwise degrees) stored in the stream, as a phone's
    portrait clip carries one.
    """
    from fractions import Fraction

    import av

    width, height = size
    container_format = "avi" if Path(path).suffix.lower() == ".avi" else "mp4"  # an .avi clip, as cameras write
    with av.open(str(path), mode="w", format=container_format) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for number in range(frames):
            image = Image.new("RGB", size, ((index * 70) % 256, 90, 200 - index * 30 % 200))
            side = min(width, height) // 3
            left = (number * max(1, (width - side) // max(1, frames - 1))) % max(1, width - side)
            ImageDraw.Draw(image).rectangle((left, height // 3, left + side, height // 3 + side), fill=(240, 230, 40))
            for packet in stream.encode(av.VideoFrame.from_image(image)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_clip_dataset(folder: Path, clips: int = 2, images: int = 1, *, frames: int = 9, size: int = 64,
                       fps: int = 16) -> Path:
    """``clips`` real MP4 clips and ``images`` PNGs side by side, each with a ``.txt`` caption."""
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(clips):
        clip = write_clip(folder / f"clip_{index:03d}.mp4", frames, (size, size), fps, index=index)
        clip.with_suffix(".txt").write_text(f"a yellow square sliding, {CAPTIONS[index % len(CAPTIONS)]}",
                                            encoding="utf-8")
    if images:
        write_dataset(folder / "stills", count=images, size=size)
    return folder
