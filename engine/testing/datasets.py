"""Small real image datasets on disk, for tests, demos and benchmarks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw

CAPTIONS = (
    "a red circle on a blue background",
    "a yellow square on a green background",
    "a white triangle on a black background",
    "a purple ring on an orange background",
)


def write_dataset(
    folder: Path, count: int = 4, size: int = 64, *, metadata: bool = False,
    shapes: Sequence[tuple[int, int]] | None = None,
) -> Path:
    """``count`` drawn PNGs with captions: ``.txt`` sidecars, or one ``metadata.jsonl``.

    ``shapes``: (width, height) per image, in turn (aspect buckets); else ``size`` square.
    """
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(count):
        width, height = shapes[index % len(shapes)] if shapes else (size, size)
        image = Image.new("RGB", (width, height), ((index * 70) % 256, 90, 200 - index * 30 % 200))
        draw = ImageDraw.Draw(image)
        inset = min(width, height) // 4 + index % 3
        draw.ellipse((inset, inset, width - inset, height - inset), fill=(230, 40 + index * 40 % 200, 40))
        name = f"image_{index:03d}.png"
        image.save(folder / name)
        caption = CAPTIONS[index % len(CAPTIONS)]
        if metadata:
            lines.append(json.dumps({"file_name": name, "text": caption}))
        else:
            (folder / name).with_suffix(".txt").write_text(caption, encoding="utf-8")
    if metadata:
        (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def write_clip(path: Path, frames: int = 9, size: tuple[int, int] = (64, 64), fps: int = 16, *,
               index: int = 0, rotation: int | None = None) -> Path:
    """A real H.264 clip through PyAV: a square sliding across a coloured field (motion to learn).

    ``rotation``: a display rotation (counter-clockwise degrees) stored in the stream, as a phone's
    portrait clip carries one.
    """
    from fractions import Fraction

    import av

    width, height = size
    with av.open(str(path), mode="w", format="mp4") as container:
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
