"""Training data: find every image and its caption, and decode each one now.

A corrupt upload must fail the start, not the trainer halfway through a run
after the GPU was freed. Every image is fully decoded (EXIF transposed)
before anything is evicted; all bad files are listed in one error, so a user
fixes the folder once. Files that are not images are skipped and reported.

Captions come from ``metadata.jsonl`` at the dataset root (``file_name`` and
``text`` or ``caption``; names matched as posix paths relative to the root,
so a dataset made on Windows works on Linux), or from a ``.txt`` /
``.caption`` file beside the image.

Every file is confined to the dataset folder by its real path: a symlink
(image, caption or ``metadata.jsonl``) that leads outside the folder's own
real path refuses the whole dataset, naming the file, before any of them is
opened. Folder symlinks are not followed (one leading out is refused the
same way), and what is not a regular file (a FIFO, a device) is skipped.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from PIL import Image, ImageOps, UnidentifiedImageError

from engine.errors import PreflightError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_EXTENSIONS = (".txt", ".caption")
METADATA = "metadata.jsonl"
#: PIL's own decompression-bomb limit (about 89 megapixels).
DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


@dataclass(frozen=True)
class DatasetItem:
    image: Path
    relative: str
    caption: str
    size: tuple[int, int]


@dataclass(frozen=True)
class DatasetReport:
    root: Path
    items: tuple[DatasetItem, ...]
    #: (relative path, why) for files that were not used.
    skipped: tuple[tuple[str, str], ...] = ()
    uncaptioned: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, object]:
        return {
            "root": str(self.root),
            "images": len(self.items),
            "uncaptioned": list(self.uncaptioned),
            "skipped": [{"file": f, "reason": r} for f, r in self.skipped],
        }


class DatasetError(PreflightError):
    """Bad dataset files, all of them at once."""

    code = "bad_dataset"

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None, *, code: str | None = None) -> None:
        self.problems = problems or []
        if self.problems:
            message += "".join(f"\n  {name}: {reason}" for name, reason in self.problems)
        super().__init__(message, code=code)


def discover_dataset(root: Path | str, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> DatasetReport:
    """Every usable image with its caption; :class:`DatasetError` lists what is broken."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetError(f"dataset folder {root} does not exist or is not a folder", code="dataset_not_found")
    files, skipped, outside = _confined_files(root)
    if outside:
        raise DatasetError(
            f"{len(outside)} file(s) in {root} are symlinks that lead outside the dataset folder; "
            "copy the files into the folder instead:",
            outside,
            code="path_outside_root",
        )
    captions = _metadata_captions(root)
    items: list[DatasetItem] = []
    problems: list[tuple[str, str]] = []
    uncaptioned: list[str] = []
    for path in files:
        relative = path.relative_to(root).as_posix()
        suffix = path.suffix.lower()
        if suffix not in IMAGE_EXTENSIONS:
            if suffix not in CAPTION_EXTENSIONS and path.name != METADATA:
                skipped.append((relative, f"not an image ({suffix or 'no extension'})"))
            continue
        problem, size = _decode(path, max_pixels)
        if problem:
            problems.append((relative, problem))
            continue
        caption = captions.get(relative)
        if caption is None:
            caption = _sidecar_caption(path)
        if caption is None:
            uncaptioned.append(relative)
            caption = ""
        # The real path: the trainer reads what was checked, even if a link is swapped later.
        items.append(DatasetItem(Path(os.path.realpath(path)), relative, caption, size))
    if problems:
        raise DatasetError(
            f"{len(problems)} of {len(problems) + len(items)} images in {root} cannot be decoded; "
            "fix or remove them and start again:",
            problems,
        )
    if not items:
        raise DatasetError(
            f"no images in {root} (looked for {', '.join(IMAGE_EXTENSIONS)})", code="empty_dataset"
        )
    return DatasetReport(root, tuple(items), tuple(skipped), tuple(uncaptioned))


def _confined_files(root: Path) -> tuple[list[Path], list[tuple[str, str]], list[tuple[str, str]]]:
    """Regular files under ``root`` whose real path is inside ``root``'s, sorted;
    (relative, why) for entries skipped; (relative, why) for entries leading out.

    Folder symlinks are never descended (no loops, no second way in); every
    other entry is judged by ``realpath``, so a link chain is followed to its end.
    """
    real_root = Path(os.path.realpath(root))
    files: list[Path] = []
    skipped: list[tuple[str, str]] = []
    outside: list[tuple[str, str]] = []
    for folder, dirs, names in os.walk(root):  # followlinks=False
        for name in sorted([*dirs, *names]):
            path = Path(folder) / name
            relative = path.relative_to(root).as_posix()
            real = Path(os.path.realpath(path))
            if real != real_root and real_root not in real.parents:
                outside.append((relative, "a symlink that leads outside the dataset folder"))
            elif name in dirs:
                if path.is_symlink():
                    skipped.append((relative, "a symlink to a folder (not followed)"))
            elif not real.exists():
                skipped.append((relative, "a broken symlink"))
            elif not real.is_file():
                skipped.append((relative, "not a regular file"))
            else:
                files.append(path)
    return sorted(files), skipped, outside


def _decode(path: Path, max_pixels: int) -> tuple[str | None, tuple[int, int]]:
    if path.stat().st_size == 0:
        return "empty file (0 bytes)", (0, 0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                if image.width * image.height > max_pixels:
                    return (
                        f"decompression bomb: {image.width}x{image.height} is over the "
                        f"{max_pixels:,}-pixel limit",
                        (0, 0),
                    )
                upright = ImageOps.exif_transpose(image)
                upright.load()
                return None, upright.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        return f"decompression bomb: {exc}", (0, 0)
    except UnidentifiedImageError:
        return "not an image PIL can read", (0, 0)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"cannot be decoded ({exc})", (0, 0)


def _metadata_captions(root: Path) -> dict[str, str]:
    path = root / METADATA
    if not path.is_file():
        return {}
    captions: dict[str, str] = {}
    problems: list[tuple[str, str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            name = str(record["file_name"])
            text = record.get("text", record.get("caption"))
        except (ValueError, KeyError, TypeError) as exc:
            problems.append((f"{METADATA}:{number}", f"not a JSON object with file_name ({exc})"))
            continue
        if not isinstance(text, str):
            problems.append((f"{METADATA}:{number}", "no text or caption string"))
            continue
        captions[PurePosixPath(name.replace("\\", "/")).as_posix().removeprefix("./")] = text.strip()
    if problems:
        raise DatasetError(f"{path} has malformed lines:", problems)
    return captions


def _sidecar_caption(image: Path) -> str | None:
    for extension in CAPTION_EXTENSIONS:
        sidecar = image.with_suffix(extension)
        if sidecar.is_file():
            return sidecar.read_text(encoding="utf-8").strip()
    return None
