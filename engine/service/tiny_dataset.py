"""``tiny dataset``: a few drawn, captioned images on disk, a dataset to train on with no download.

The service's ``tiny_dataset`` (the CLI's ``tiny dataset``, the demo) writes one; the
test kit (:mod:`engine.testing.datasets`) reuses it for its own datasets.
"""

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
