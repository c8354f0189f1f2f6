"""Training datasets under the configured roots: list, look, upload, caption, delete.

The web page's dataset manager and ``/v1/datasets`` work through this one
class, over the same files the trainer reads (:mod:`engine.preflight.dataset`):
a caption is what a run would train with, in the trainer's precedence
(``metadata.jsonl`` first, then a ``.txt`` / ``.caption`` file beside the
image), and an edit writes it where the trainer will read it back.

Every path is confined twice: a dataset is a plain folder name directly under
a root, and an image a path inside that dataset whose real path stays there
(``..``, absolute paths and symlinks leading out are refused). An upload is
written beside its final name, decoded in full (a bomb or a corrupt file is
refused), and then linked into place without replacing anything: two
uploads of one name cannot overwrite each other. Decoding (an upload's check,
a thumbnail) takes the image inputs' header cap, one image at a time in the
process, and a thumbnail once made is kept (keyed by the file's size and
modification time): a page of thumbnails, or a cross-site ``<img>`` flood,
costs one decode per image, never many at once. A dataset a training run
is using (in this engine or in another process) is not changed
(``dataset_in_use``, 409): the run has already checked and cached its files.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from PIL import Image

from engine import stored
from engine.errors import EngineError
from engine.places import NAME_MAX, within
from engine.preflight.images import MAX_INPUT_PIXELS
from engine.preflight.clips import CLIP_EXTENSIONS, ClipProblem, clip_header, first_frame, probe_clip
from engine.preflight.dataset import (
    CAPTION_EXTENSIONS,
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    METADATA,
    DatasetError,
    confined_files,
    decode_image,
    metadata_captions,
)

#: A dataset's name: one folder directly under a root.
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._ -]{0,127}")
#: Thumbnail sides a client may ask for.
THUMBNAIL_SIZES = range(16, 1025)
#: The most images one listing returns.
MAX_LISTED = 2000

#: Thumbnails kept in memory, newest used last.
THUMBNAILS_KEPT = 512
#: One image decoded at a time in this process (uploads' checks and thumbnails).
_DECODE = threading.Lock()
_THUMBNAILS: OrderedDict[tuple[str, int, int, int], bytes] = OrderedDict()

#: Who is training on a folder: its run id, or None.
InUse = Callable[[Path], "str | None"]


class DatasetChangeRefused(EngineError):
    """A change the library will not make (a name in use, a dataset a run is using)."""


class DatasetLibrary:
    """The datasets under ``roots`` (the first root takes new datasets)."""

    def __init__(self, roots: Sequence[Path | str], in_use: InUse, *,
                 max_pixels: int = min(DEFAULT_MAX_PIXELS, MAX_INPUT_PIXELS)) -> None:
        self.roots = tuple(Path(root).expanduser() for root in roots)
        self._in_use = in_use
        self.max_pixels = max_pixels

    # -- reading ----------------------------------------------------------------------

    def datasets(self) -> list[dict[str, object]]:
        """Each dataset folder: name, path, image and clip counts, captioned count, and the run using it."""
        found: dict[str, dict[str, object]] = {}
        for root in self.roots:
            if not root.is_dir():
                continue
            for entry in sorted(root.iterdir()):
                if entry.name in found or not DATASET_NAME.fullmatch(entry.name) or entry.is_symlink():
                    continue
                if entry.is_dir():
                    images = self._images(entry)
                    clips = sum(1 for image in images if image["kind"] == "clip")
                    found[entry.name] = {
                        "name": entry.name, "path": str(entry.resolve()), "images": len(images) - clips,
                        "clips": clips, "captioned": sum(1 for image in images if image["caption"]),
                        "in_use_by": self._in_use(entry.resolve()),
                    }
        return list(found.values())

    def dataset(self, name: str) -> dict[str, object]:
        """One dataset: its images with their captions and where each caption comes from."""
        folder = self._folder(name)
        images = self._images(folder)
        return {"name": name, "path": str(folder), "images": images[:MAX_LISTED], "count": len(images),
                "in_use_by": self._in_use(folder)}

    def thumbnail(self, name: str, image: str, size: int = 256) -> bytes:
        """A PNG of at most ``size`` px on its longer side (EXIF orientation applied)."""
        from PIL import ImageOps

        if size not in THUMBNAIL_SIZES:
            raise EngineError(f"size must be {THUMBNAIL_SIZES.start}-{THUMBNAIL_SIZES.stop - 1} px (got {size})",
                              code="invalid_request")
        path = self._image(self._folder(name), image)
        info = path.stat()
        key = (os.path.realpath(path), info.st_mtime_ns, info.st_size, size)
        with _DECODE:
            if key in _THUMBNAILS:
                _THUMBNAILS.move_to_end(key)
                return _THUMBNAILS[key]
            problem = _problem(path, self.max_pixels)
            if problem:
                raise EngineError(f"{name}/{image}: {problem}", code="invalid_image")
            if _is_clip(path):  # a clip's thumbnail is its first frame, upright
                upright = first_frame(path)
            else:
                with Image.open(path) as opened:
                    upright = ImageOps.exif_transpose(opened)
                    upright.load()
            upright.thumbnail((size, size))
            out = io.BytesIO()
            upright.convert("RGBA" if upright.mode in ("RGBA", "LA", "P") else "RGB").save(out, "PNG")
            _THUMBNAILS[key] = out.getvalue()
            while len(_THUMBNAILS) > THUMBNAILS_KEPT:
                _THUMBNAILS.popitem(last=False)
            return _THUMBNAILS[key]

    # -- changing -----------------------------------------------------------------------

    def add_images(self, name: str, files: Sequence[tuple[str, bytes]]) -> dict[str, object]:
        """Upload ``files`` (file name, bytes) into dataset ``name``, created if new.

        Every file is checked before any is kept: a bad name, a name already
        there (``image_exists``), a file that does not decode (``invalid_image``)
        refuses the whole upload and leaves the folder as it was.
        """
        if not files:
            raise EngineError("the upload holds no files (multipart field 'files')", code="invalid_request")
        folder = self._folder(name, create=True)
        self._refuse_if_in_use(folder)
        names = [self._upload_name(filename) for filename, _ in files]
        if len(set(names)) != len(names):
            raise DatasetChangeRefused("the upload names one file twice", code="image_exists")
        taken = [n for n in names if (folder / n).exists() or (folder / n).is_symlink()]
        if taken:
            raise DatasetChangeRefused(
                f"{name} already has {', '.join(taken)}; delete it first or rename the upload", code="image_exists")
        staged: list[tuple[Path, Path]] = []
        try:
            for target, (_, data) in zip(names, files, strict=True):
                temporary = folder / f".upload-{secrets.token_hex(8)}.tmp"
                temporary.write_bytes(data)
                staged.append((temporary, folder / target))
                with _DECODE:
                    problem = _problem(temporary, self.max_pixels, Path(target).suffix)
                if problem:
                    raise EngineError(f"{target}: {problem}; nothing was added", code="invalid_image")
            for temporary, final in staged:
                try:
                    os.link(temporary, final)  # fails rather than replace a file that appeared meanwhile
                except FileExistsError:
                    raise DatasetChangeRefused(f"{name} already has {final.name}", code="image_exists") from None
        finally:
            for temporary, _ in staged:
                temporary.unlink(missing_ok=True)
        return {"name": name, "added": names, "count": len(self._images(folder))}

    def set_caption(self, name: str, image: str, caption: str) -> dict[str, object]:
        """Write ``image``'s caption where the trainer reads it; an empty caption clears it.

        An image captioned in ``metadata.jsonl`` has that line rewritten (or
        dropped, to clear); otherwise its ``.txt`` (or existing ``.caption``)
        file is written (or removed).
        """
        folder = self._folder(name)
        self._refuse_if_in_use(folder)
        path = self._image(folder, image)
        relative = path.relative_to(folder).as_posix()
        text = caption.strip()
        if relative in _metadata(folder):
            _rewrite_metadata(folder, relative, text)
        else:
            sidecars = [path.with_suffix(ext) for ext in CAPTION_EXTENSIONS]
            existing = next((s for s in sidecars if s.is_file()), sidecars[0])
            if text:
                _confined(folder, existing).write_text(text + "\n", encoding="utf-8")
            else:
                for sidecar in sidecars:
                    _confined(folder, sidecar).unlink(missing_ok=True)
        return self._entry(folder, path)

    def remove_image(self, name: str, image: str) -> dict[str, object]:
        """Delete ``image``, its caption files and its ``metadata.jsonl`` line."""
        folder = self._folder(name)
        self._refuse_if_in_use(folder)
        path = self._image(folder, image)
        relative = path.relative_to(folder).as_posix()
        # Every check before the first removal: a refusal never comes after a file is gone.
        sidecars = [_confined(folder, path.with_suffix(extension)) for extension in CAPTION_EXTENSIONS]
        captioned = relative in _metadata(folder)
        path.unlink()
        for sidecar in sidecars:
            sidecar.unlink(missing_ok=True)
        if captioned:
            _rewrite_metadata(folder, relative, None)
        return {"name": name, "removed": relative, "count": len(self._images(folder))}

    # -- confinement ----------------------------------------------------------------------

    def _folder(self, name: str, *, create: bool = False) -> Path:
        if not DATASET_NAME.fullmatch(name):
            raise EngineError(
                f"{name!r} is not a dataset name: letters, digits, '.', '_', '-' and spaces, not starting "
                "with '.' (one folder directly under a dataset root)", code="path_outside_roots")
        for root in self.roots:
            folder = root / name
            if folder.is_dir() and not folder.is_symlink():
                return folder.resolve()
        if not self.roots:
            raise EngineError("this server has no dataset root; start it with --datasets DIR",
                              code="dataset_not_found")
        if not create:
            raise EngineError(f"no dataset {name!r} under {', '.join(map(str, self.roots))}",
                              code="dataset_not_found")
        folder = self.roots[0] / name
        if folder.exists() or folder.is_symlink():  # a plain file, a symlink (dangling or leading anywhere)
            raise EngineError(f"{name!r} under {self.roots[0]} is not a dataset folder (a file or a symlink); "
                              "pick another name", code="path_outside_roots")
        folder.mkdir(parents=True)
        return folder.resolve()

    def _image(self, folder: Path, image: str) -> Path:
        relative = PurePosixPath(image.replace("\\", "/"))
        if any(len(part.encode("utf-8", "surrogatepass")) > NAME_MAX for part in relative.parts):
            raise EngineError(f"{image[:80]!r}...: a name longer than {NAME_MAX} bytes", code="invalid_request")
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise EngineError(f"{image!r} is not an image path inside the dataset", code="path_outside_roots")
        path = folder / relative
        if path.suffix.lower() not in MEDIA_EXTENSIONS:
            raise EngineError(f"{image!r} is not an image or a clip ({', '.join(MEDIA_EXTENSIONS)})",
                              code="invalid_image")
        _confined(folder, path)
        if not path.is_file():
            raise EngineError(f"no image {image!r} in dataset {folder.name}", code="image_not_found")
        return path

    def _upload_name(self, filename: str) -> str:
        name = filename.replace("\\", "/")
        if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX:
            raise EngineError(f"upload name {filename[:80]!r}... is longer than {NAME_MAX} bytes",
                              code="invalid_request")
        if "/" in name or name in ("", ".", "..") or name.startswith(".") or "\x00" in name:
            raise EngineError(f"upload name {filename!r} must be a plain file name (no folders, not hidden)",
                              code="path_outside_roots")
        if Path(name).suffix.lower() not in MEDIA_EXTENSIONS:
            raise EngineError(f"{filename!r} is not an image or clip file name ({', '.join(MEDIA_EXTENSIONS)})",
                              code="invalid_image")
        return name

    def _refuse_if_in_use(self, folder: Path) -> None:
        run = self._in_use(folder)
        if run is not None:
            raise DatasetChangeRefused(
                f"dataset {folder.name} is being trained on by run {run}; change it when the run has finished "
                "(the run already checked and cached these files)", code="dataset_in_use")

    # -- listing ------------------------------------------------------------------------

    def _images(self, folder: Path) -> list[dict[str, object]]:
        files, _, _ = confined_files(folder)
        captions = _metadata(folder)
        return [self._entry(folder, path, captions) for path in files if path.suffix.lower() in MEDIA_EXTENSIONS]

    def _entry(self, folder: Path, path: Path, captions: dict[str, str] | None = None) -> dict[str, object]:
        relative = path.relative_to(folder).as_posix()
        captions = _metadata(folder) if captions is None else captions
        if relative in captions:
            caption, source = captions[relative], METADATA
        else:
            sidecar = next((path.with_suffix(e) for e in CAPTION_EXTENSIONS if path.with_suffix(e).is_file()), None)
            caption = sidecar.read_text(encoding="utf-8").strip() if sidecar else ""
            source = sidecar.name if sidecar else None
        seconds: float | None = None
        try:
            if _is_clip(path):  # the container's header only
                width, height, seconds = clip_header(path)
                problem = None
            else:
                with Image.open(path) as opened:  # the header only
                    width, height, problem = opened.width, opened.height, None
        except ClipProblem as exc:
            width = height = 0
            problem = str(exc)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            width = height = 0
            problem = f"not a readable image ({exc})"
        return {"image": relative, "caption": caption, "caption_source": source if caption else None,
                "width": width, "height": height, "bytes": path.stat().st_size, "problem": problem,
                "kind": "clip" if _is_clip(path) else "image", "seconds": seconds}


#: What a dataset holds: images and clips (an image trains as a one-frame clip on a video family).
MEDIA_EXTENSIONS: tuple[str, ...] = (*IMAGE_EXTENSIONS, *CLIP_EXTENSIONS)


def media_counts(folder: Path) -> dict[str, int]:
    """The images and clips under ``folder`` as a run finds them (confined, by name; nothing decoded)."""
    files, _, _ = confined_files(folder)
    suffixes = [path.suffix.lower() for path in files]
    return {"images": sum(suffix in IMAGE_EXTENSIONS for suffix in suffixes),
            "clips": sum(suffix in CLIP_EXTENSIONS for suffix in suffixes)}


def _is_clip(path: Path, suffix: str | None = None) -> bool:
    return (suffix or path.suffix).lower() in CLIP_EXTENSIONS


def _problem(path: Path, max_pixels: int, suffix: str | None = None) -> str | None:
    """Why ``path`` (an upload keeps its name's ``suffix``) cannot be trained on, decoded in full
    under the pixel cap; None when it reads."""
    if not _is_clip(path, suffix):
        return decode_image(path, max_pixels)[0]
    try:
        probe_clip(path, max_pixels)
    except ClipProblem as exc:
        return str(exc)
    return None


def _confined(folder: Path, path: Path) -> Path:
    """``path`` if its real path stays in ``folder``; else ``path_outside_roots``."""
    if not within(folder, path):
        raise EngineError(f"{path.name} leads outside dataset {folder.name} (a symlink?)", code="path_outside_roots")
    return path


def _metadata(folder: Path) -> dict[str, str]:
    try:
        return metadata_captions(folder)
    except DatasetError as error:  # a malformed metadata.jsonl: say which lines, as a start would
        raise EngineError(error.message, code="bad_dataset") from None


def _rewrite_metadata(folder: Path, relative: str, text: str | None) -> None:
    """Set (``text``) or drop (None, or empty) ``relative``'s line in ``metadata.jsonl``, atomically."""
    path = _confined(folder, folder / METADATA)
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = stored.parse_json(line, path)
            name = PurePosixPath(str(record["file_name"]).replace("\\", "/")).as_posix().removeprefix("./")
            if name == relative:
                if not text:
                    continue
                record.pop("caption", None)
                record["text"] = text
                line = json.dumps(record, ensure_ascii=False)
        lines.append(line)
    temporary = path.with_name(f".{METADATA}.{secrets.token_hex(4)}.tmp")
    temporary.write_text("\n".join(lines) + ("\n" if lines else ""), encoding="utf-8")
    os.replace(temporary, path)
