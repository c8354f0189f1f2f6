"""Training data: find every image and clip and its caption, and decode each one now.

A corrupt upload must fail the start, not the trainer halfway through a run
after the GPU was freed. Every image is fully decoded (EXIF transposed)
before anything is evicted; all bad files are listed in one error, so a user
fixes the folder once. Files that are not images are skipped and reported.

Clips (``.mp4 .mov .mkv .webm .m4v``) sit beside images: each is probed
and decoded as far as the run's window reaches (:mod:`engine.preflight.clips`;
an image is a one-frame clip), and a clip that is empty, corrupt, has no video
stream or an absurd header is named with the broken images. A clip shorter
than the window is refused (``short_clips="refuse"``) or padded; a longer one
is cut, and a variable frame rate one is sampled by its timestamps: both noted.

Captions come from ``metadata.jsonl`` at the dataset root (``file_name`` and
``text`` or ``caption``; names matched as posix paths relative to the root,
so a dataset made on Windows works on Linux), or from a ``.txt`` /
``.caption`` file beside the image.

The report also names what would quietly hurt a run: images with no or an
empty caption, images under half the training resolution (enlarged more than
2x; refused with ``strict``), exact duplicates (same bytes, by SHA-256), and
``metadata.jsonl`` lines naming an image the folder does not have.

Every file is confined to the dataset folder by its real path: a symlink
(image, caption or ``metadata.jsonl``) that leads outside the folder's own
real path refuses the whole dataset, naming the file, before any of them is
opened. Folder symlinks are not followed (one leading out is refused the
same way), and what is not a regular file (a FIFO, a device) is skipped.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from PIL import Image, ImageOps, UnidentifiedImageError

from engine import stored
from engine.errors import PreflightError
from engine.preflight.clips import CLIP_EXTENSIONS, ClipInfo, ClipProblem, ClipWindow, probe_clip
from engine.requests.references import IMAGE_EXTENSIONS

CAPTION_EXTENSIONS = (".txt", ".caption")
METADATA = "metadata.jsonl"
#: The largest ``metadata.jsonl`` read (a line per image: a million images' captions) and caption file.
MAX_METADATA_BYTES = 256 * 2**20
MAX_CAPTION_BYTES = 2**20
#: PIL's own decompression-bomb limit (about 89 megapixels).
DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


@dataclass(frozen=True)
class DatasetItem:
    image: Path
    relative: str
    caption: str
    size: tuple[int, int]
    #: A clip's probe (None: a still image, trained as a one-frame clip by a video family).
    clip: ClipInfo | None = None

    @property
    def is_clip(self) -> bool:
        return self.clip is not None


@dataclass(frozen=True)
class DatasetReport:
    root: Path
    items: tuple[DatasetItem, ...]
    #: (relative path, why) for files that were not used.
    skipped: tuple[tuple[str, str], ...] = ()
    #: Images with no caption, or an empty one (trained with the empty prompt).
    uncaptioned: tuple[str, ...] = field(default=())
    #: (relative path, "WxH") of images under half the training resolution.
    small: tuple[tuple[str, str], ...] = ()
    #: Groups of images with identical bytes (each group sorted, two or more).
    duplicates: tuple[tuple[str, ...], ...] = ()
    #: ``metadata.jsonl`` file names with no image in the folder.
    missing_images: tuple[str, ...] = ()
    #: The training resolution the sizes were judged against (None: not judged).
    resolution: int | None = None
    #: The window clips were judged against (None: no clips, or not judged).
    window: ClipWindow | None = None
    #: (relative path, note) of clips cut to the window, padded to it, or of a variable frame rate.
    cut: tuple[tuple[str, str], ...] = ()
    padded: tuple[tuple[str, str], ...] = ()
    variable_rate: tuple[str, ...] = ()
    #: Clips with no sound, where the run trains a clip's sound: they train the picture alone.
    silent: tuple[str, ...] = ()

    @property
    def clips(self) -> int:
        return sum(1 for item in self.items if item.is_clip)

    def to_dict(self) -> dict[str, object]:
        return {
            "root": str(self.root),
            "images": len(self.items) - self.clips,
            "clips": self.clips,
            "window": self.window.to_dict() if self.window else None,
            "cut": [{"file": f, "note": n} for f, n in self.cut],
            "padded": [{"file": f, "note": n} for f, n in self.padded],
            "variable_rate": list(self.variable_rate),
            "silent": list(self.silent),
            "uncaptioned": list(self.uncaptioned),
            "skipped": [{"file": f, "reason": r} for f, r in self.skipped],
            "small": [{"file": f, "size": s} for f, s in self.small],
            "duplicates": [list(group) for group in self.duplicates],
            "missing_images": list(self.missing_images),
            "warnings": self.warnings(),
        }

    def warnings(self) -> list[str]:
        """One line per finding, for the dry run and the run's record."""
        lines = [f"skipped {file}: {reason}" for file, reason in self.skipped]
        if self.uncaptioned:
            lines.append(f"{len(self.uncaptioned)} image(s) have no caption or an empty one (trained with the "
                         f"empty prompt): {_names(self.uncaptioned)}")
        if self.small:
            lines.append(f"{len(self.small)} image(s) are under half the training resolution ({self.resolution} px) "
                         "and are enlarged more than 2x (refused with --strict): "
                         + _names([f"{f} ({s})" for f, s in self.small]))
        lines += [f"identical images (same bytes): {', '.join(group)}" for group in self.duplicates]
        lines += [f"{METADATA} has a caption for {name}, which is not an image in the folder" for name in self.missing_images]
        lines += [f"{file} is longer than the window and is cut: {note}" for file, note in self.cut]
        lines += [f"{file} is shorter than the window and is padded (its last frame held): {note}"
                  for file, note in self.padded]
        if self.variable_rate:
            lines.append(f"{len(self.variable_rate)} clip(s) have a variable frame rate and are sampled by their "
                         f"timestamps: {_names(self.variable_rate)}")
        if self.silent:
            lines.append(f"{len(self.silent)} clip(s) have no sound and train the picture alone: "
                         f"{_names(self.silent)}")
        return lines


class DatasetError(PreflightError):
    """Bad dataset files, all of them at once."""

    code = "bad_dataset"

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None, *, code: str | None = None) -> None:
        self.problems = problems or []
        if self.problems:
            message += "".join(f"\n  {name}: {reason}" for name, reason in self.problems)
        super().__init__(message, code=code)


def discover_dataset(
    root: Path | str, *, max_pixels: int = DEFAULT_MAX_PIXELS, resolution: int | None = None, strict: bool = False,
    window: ClipWindow | None = None,
) -> DatasetReport:
    """Every usable image and clip with its caption; :class:`DatasetError` lists what is broken.

    :param resolution: the training resolution; images whose area is under a
        quarter of ``resolution ** 2`` (half the side) are reported in ``small``.
    :param strict: refuse small images (``small_images``) instead of reporting them.
    :param window: what a run trains of each clip (a video family's frames at its fps);
        clips are decoded that far and judged against it. None: decoded in full, not judged.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetError(f"dataset folder {root} does not exist or is not a folder", code="dataset_not_found")
    files, skipped, outside = confined_files(root)
    if outside:
        raise DatasetError(
            f"{len(outside)} file(s) in {root} are symlinks that lead outside the dataset folder; "
            "copy the files into the folder instead:",
            outside,
            code="path_outside_root",
        )
    captions = metadata_captions(root)
    items: list[DatasetItem] = []
    problems: list[tuple[str, str]] = []
    uncaptioned: list[str] = []
    hashes: dict[str, list[str]] = {}
    for path in files:
        relative = path.relative_to(root).as_posix()
        suffix = path.suffix.lower()
        if suffix not in IMAGE_EXTENSIONS and suffix not in CLIP_EXTENSIONS:
            if suffix not in CAPTION_EXTENSIONS and path.name != METADATA:
                skipped.append((relative, f"not an image or a clip ({suffix or 'no extension'})"))
            continue
        problem, size, clip = _decode(path, max_pixels, window)
        if problem:
            problems.append((relative, problem))
            continue
        hashes.setdefault(_content_hash(path), []).append(relative)
        caption = captions.get(relative)
        if caption is None:
            caption = sidecar_caption(path)
        if not caption:
            uncaptioned.append(relative)
            caption = ""
        # The real path: the trainer reads what was checked, even if a link is swapped later.
        items.append(DatasetItem(Path(os.path.realpath(path)), relative, caption, size, clip))
    if problems:
        raise DatasetError(
            f"{len(problems)} of {len(problems) + len(items)} files in {root} cannot be decoded; "
            "fix or remove them and start again:",
            problems,
        )
    if not items:
        raise DatasetError(
            f"no images or clips in {root} (looked for {', '.join(IMAGE_EXTENSIONS + CLIP_EXTENSIONS)})",
            code="empty_dataset",
        )
    cut, padded, silent = _judged(items, window)
    small = _small_images(items, resolution)
    if small and strict:
        raise DatasetError(
            f"{len(small)} of {len(items)} images in {root} are under half the training resolution "
            f"({resolution} px; strict / --strict refuses them): use larger images, a lower resolution, "
            "or leave strict off to train with them enlarged:",
            [(name, f"{size}, would be enlarged more than 2x") for name, size in small],
            code="small_images",
        )
    found = {item.relative for item in items}
    return DatasetReport(
        root, tuple(items), tuple(skipped), tuple(uncaptioned),
        small=small,
        duplicates=tuple(tuple(group) for group in hashes.values() if len(group) > 1),
        missing_images=tuple(sorted(name for name in captions if name not in found)),
        resolution=resolution,
        window=window if any(item.is_clip for item in items) else None,  # judged only where clips are
        cut=cut, padded=padded, silent=silent,
        variable_rate=tuple(item.relative for item in items if item.clip is not None and item.clip.variable_rate),
    )


def _decode(
    path: Path, max_pixels: int, window: ClipWindow | None,
) -> tuple[str | None, tuple[int, int], ClipInfo | None]:
    """A file's problem (None: it reads), its upright size, and a clip's probe (None: an image)."""
    if path.suffix.lower() not in CLIP_EXTENSIONS:
        return (*decode_image(path, max_pixels), None)
    try:
        clip = probe_clip(path, max_pixels, window)
    except ClipProblem as problem:
        return str(problem), (0, 0), None
    return None, clip.size, clip


def _judged(
    items: list[DatasetItem], window: ClipWindow | None,
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Clips cut to the window, clips padded to it, and the clips with no sound where the run
    trains a clip's sound; short clips refused unless the window pads."""
    if window is None:
        return (), (), ()
    cut, short = [], []
    for item in items:
        clip = item.clip
        if clip is None:
            continue
        if clip.window_frames < window.frames:
            short.append((item.relative, f"{clip.seconds:.2f} s holds {clip.window_frames} of the window's "
                                         f"{window.frames} frames at {window.fps:g} fps"))
        elif clip.seconds > window.seconds + 1e-6:
            cut.append((item.relative, f"the first {window.seconds:.2f} s ({window.frames} frames at "
                                       f"{window.fps:g} fps) of a longer clip"))
    if short and window.short != "pad":
        raise DatasetError(
            f"{len(short)} clip(s) are shorter than the training window ({window.frames} frames at {window.fps:g} fps, "
            f"{window.seconds:.2f} s): use fewer --frames, longer clips, or --short-clips pad to hold their last frame:",
            short,
            code="short_clips",
        )
    silent = tuple(item.relative for item in items if item.clip is not None and not item.clip.sound)
    return tuple(cut), tuple(short), silent if window.sound_rate else ()


def _small_images(items: list[DatasetItem], resolution: int | None) -> tuple[tuple[str, str], ...]:
    """Images whose area is under a quarter of the training area: covering it enlarges them over 2x."""
    if resolution is None:
        return ()
    return tuple(
        (item.relative, f"{item.size[0]}x{item.size[1]}")
        for item in items
        if math.sqrt(item.size[0] * item.size[1]) < resolution / 2
    )


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _names(names: list[str] | tuple[str, ...], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def confined_files(root: Path) -> tuple[list[Path], list[tuple[str, str]], list[tuple[str, str]]]:
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


def decode_image(path: Path, max_pixels: int) -> tuple[str | None, tuple[int, int]]:
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


def metadata_captions(root: Path) -> dict[str, str]:
    """The captions ``metadata.jsonl`` gives, by image name. The file is read only where it lies
    inside the dataset once symlinks are followed and is no larger than :data:`MAX_METADATA_BYTES`;
    a name in it only ever matches an image found inside the dataset, never opens a file."""
    path = root / METADATA
    if not path.exists() and not path.is_symlink():
        return {}
    if stored.confined_file(root, METADATA) is None:
        raise DatasetError(f"{path} is not a file inside the dataset (a link leading out of it?):",
                           [(METADATA, "replace the link with the file itself")])
    if path.stat().st_size > MAX_METADATA_BYTES:
        raise DatasetError(f"{path} is larger than {MAX_METADATA_BYTES} bytes:",
                           [(METADATA, "one line per image: split the dataset")])
    captions: dict[str, str] = {}
    problems: list[tuple[str, str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = stored.parse_json(line, path)
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


def sidecar_caption(image: Path) -> str | None:
    """The caption file beside ``image`` (``.txt``, ...), read only where it stays beside it
    once symlinks are followed (a link leading out is no caption) and is of caption size."""
    for extension in CAPTION_EXTENSIONS:
        sidecar = stored.confined_file(image.parent, image.with_suffix(extension).name)
        if sidecar is not None and sidecar.stat().st_size <= MAX_CAPTION_BYTES:
            return sidecar.read_text(encoding="utf-8", errors="replace").strip()
    return None
