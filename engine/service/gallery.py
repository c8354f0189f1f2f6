"""The gallery: every output kept with its recipe, until a limit the user set removes it.

An entry is one image (PNG) or one clip (MP4, with a PNG thumbnail) in the gallery's folder,
beside a JSON record: its kind, size, when it was made, whether it is pinned, and its recipe
(the request as it ran, every default filled, and what engaged: the plan's decisions, the
LoRAs applied). Every file is named by the entry's id (32 random hex digits), the only shape
:meth:`Gallery.get` accepts, so a caller can never name another file. The records are the
index: a gallery opened again (a restarted server) reads them back.

Bounds: ``max_bytes`` (every entry's files together) and ``max_age_s``. Opening, listing and
each add sweep: an unpinned entry older than ``max_age_s`` goes, then the oldest unpinned ones
until the rest fit ``max_bytes``; one asked for by id past its age is gone too. A pinned entry
stays whatever the limits say (it still counts in the bytes).

A record is written last, after its files (each through a temporary name), so a crash leaves
no record without its file; files without a record for an hour are removed when the gallery
opens. Several processes may share one folder (a server's replicas): each re-reads the
records whenever the folder changed, so each lists what the others kept.

Nothing a record says moves a path or a limit (:mod:`engine.stored`): an entry's id is its
record's file name, its bytes and age are its files' sizes and modification time on disk, a
file is served only when it stays in the folder once symlinks are followed, every other field
is validated, and a record that fails any of it (or whose file is gone) is logged and left out
of the index, never a crash of the listing. A gallery folder that is a symlink leading out of
its parent is refused when the gallery opens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from engine import stored
from engine.errors import EngineError

log = logging.getLogger(__name__)

Kind = Literal["image", "video"]
ID = re.compile(r"[0-9a-f]{32}")
#: Each kind's file suffix and media type.
MEDIA: dict[str, tuple[str, str]] = {"image": (".png", "image/png"), "video": (".mp4", "video/mp4")}
THUMBNAIL = ".thumb.png"
#: The most entries one page lists.
MAX_PAGE = 200
#: Seconds a file may lie without its record before an opening gallery removes it (a write cut short).
ORPHAN_S = 3600.0


class GalleryEntryNotFound(EngineError):
    """No entry by that id: never kept here, deleted, or removed by the gallery's limits (a 404)."""

    code = "gallery_entry_not_found"


@dataclass(frozen=True)
class GalleryEntry:
    """One kept output: its record (the JSON beside its file)."""

    #: Read back: the record's file name, never its contents.
    id: str
    kind: Kind
    #: Read back: its file's modification time (what the age bound acts on).
    created: float
    #: Bytes of its files: the image or clip, and a clip's thumbnail (the record is not counted).
    #: Read back: the sizes on disk (what the size bound acts on).
    bytes: int
    width: Annotated[int, Field(ge=1, le=65536)]
    height: Annotated[int, Field(ge=1, le=65536)]
    pinned: bool
    #: The generate job that made it (a server's job id), or None.
    job: Annotated[str, Field(max_length=200)] | None
    #: The request as it ran and what engaged (see :mod:`engine.service.recipes`).
    recipe: dict[str, Any]

    @property
    def media_type(self) -> str:
        return MEDIA[self.kind][1]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "created": round(self.created, 3), "media_type": self.media_type,
                "thumbnail": self.kind == "video"}


class Gallery:
    """The entries in ``folder``; thread-safe (one lock around the index and the files)."""

    def __init__(self, folder: Path | str, *, max_bytes: int | None = None, max_age_s: float | None = None) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_age_s", max_age_s)):
            if value is not None and not 0 < value < float("inf"):
                raise EngineError(f"the gallery's {name} must be a positive number (got {value}); "
                                  "leave it unset for no limit", code="invalid_config")
        self.folder = stored.confined_root(Path(folder), Path(folder).parent, what="gallery folder")
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self._lock = threading.Lock()
        self._entries: dict[str, GalleryEntry] = {}
        #: The folder's modification time when its records were last read.
        self._seen = -1
        self.sweep()
        self._clear_orphans()

    # -- reading ----------------------------------------------------------------------

    def page(self, *, offset: int = 0, limit: int = 50, kind: str | None = None,
             pinned: bool | None = None) -> dict[str, Any]:
        """A page of entries, newest first: ``{"data", "total", "offset", "limit", "next_offset",
        "bytes", "max_bytes", "max_age_s"}`` (``next_offset``: None on the last page)."""
        if offset < 0 or not 1 <= limit <= MAX_PAGE:
            raise EngineError(f"offset must be 0 or more and limit 1 to {MAX_PAGE}", code="invalid_request")
        self.sweep()
        with self._lock:
            chosen = [e for e in self._entries.values()
                      if (kind is None or e.kind == kind) and (pinned is None or e.pinned == pinned)]
            held = sum(e.bytes for e in self._entries.values())
        chosen.sort(key=lambda e: e.created, reverse=True)
        page = chosen[offset:offset + limit]
        after = offset + len(page)
        return {"data": [e.to_dict() for e in page], "total": len(chosen), "offset": offset, "limit": limit,
                "next_offset": after if after < len(chosen) else None, "bytes": held,
                "max_bytes": self.max_bytes, "max_age_s": self.max_age_s}

    def get(self, entry_id: str) -> GalleryEntry:
        with self._lock:
            self._refresh()
            entry = self._entries.get(entry_id) if ID.fullmatch(entry_id) else None
            if entry is not None and self._expired(entry):
                self._remove(entry)
                entry = None
        if entry is None:
            raise GalleryEntryNotFound(f"no gallery entry {entry_id[:80]!r} (deleted, removed by the gallery's "
                                       "limits, or never kept here); list them at GET /v1/gallery")
        return entry

    def file(self, entry_id: str, variant: str = "file") -> tuple[Path, str]:
        """The path and media type of an entry's file (``thumbnail``: a clip's first-frame PNG)."""
        entry = self.get(entry_id)
        if variant not in ("file", "thumbnail"):
            raise EngineError(f"variant {variant[:40]!r} is not file or thumbnail", code="invalid_request")
        name, media_type = f"{entry.id}{MEDIA[entry.kind][0]}", entry.media_type
        if variant == "thumbnail" and entry.kind == "video":
            name, media_type = f"{entry.id}{THUMBNAIL}", "image/png"
        path = stored.confined_file(self.folder, name)
        if path is None:  # removed, or replaced by a link leading out, since the index was read
            raise GalleryEntryNotFound(f"gallery entry {entry.id}'s file is gone; list them at GET /v1/gallery")
        return path, media_type

    # -- changing -----------------------------------------------------------------------

    def add(self, kind: Kind, data: bytes, *, recipe: dict[str, Any], width: int, height: int,
            thumbnail: bytes | None = None, job: str | None = None) -> GalleryEntry:
        """Keep one output (its files, then its record), then sweep to the limits."""
        entry_id = secrets.token_hex(16)
        files = {f"{entry_id}{MEDIA[kind][0]}": data, **({f"{entry_id}{THUMBNAIL}": thumbnail} if thumbnail else {})}
        for name, content in files.items():
            _write(self.folder / name, content)
        entry = GalleryEntry(entry_id, kind, time.time(), sum(len(c) for c in files.values()), width, height,
                             False, job, recipe)
        self._record(entry)
        with self._lock:
            self._entries[entry_id] = entry
        self.sweep()
        return entry

    def pin(self, entry_id: str, pinned: bool = True) -> GalleryEntry:
        """Pin an entry (the limits never remove it) or unpin it."""
        entry = replace(self.get(entry_id), pinned=pinned)
        self._record(entry)
        with self._lock:
            self._entries[entry.id] = entry
        return entry

    def delete(self, entry_id: str) -> GalleryEntry:
        """Remove an entry and its files (pinned or not)."""
        entry = self.get(entry_id)
        with self._lock:
            self._remove(entry)
        return entry

    def sweep(self) -> list[str]:
        """Remove the unpinned entries past the limits, oldest first; their ids."""
        removed: list[str] = []
        with self._lock:
            self._refresh()
            oldest = sorted(self._entries.values(), key=lambda e: e.created)
            for entry in [e for e in oldest if self._expired(e)]:
                self._remove(entry)
                removed.append(entry.id)
            held = sum(e.bytes for e in self._entries.values())
            for entry in oldest:
                if self.max_bytes is None or held <= self.max_bytes:
                    break
                if not entry.pinned and entry.id in self._entries:
                    held -= entry.bytes
                    self._remove(entry)
                    removed.append(entry.id)
        return removed

    def _expired(self, entry: GalleryEntry) -> bool:
        return self.max_age_s is not None and not entry.pinned and entry.created < time.time() - self.max_age_s

    # -- on disk ------------------------------------------------------------------------

    def _record(self, entry: GalleryEntry) -> None:
        """Write ``entry``'s record (after its files: see the module doc)."""
        _write(self.folder / f"{entry.id}.json", json.dumps(asdict(entry), default=str, indent=1).encode())

    def _remove(self, entry: GalleryEntry) -> None:
        """(Under the lock.) The record first, so a crash between leaves only files the next open clears."""
        self._entries.pop(entry.id, None)
        for suffix in (".json", MEDIA[entry.kind][0], THUMBNAIL):
            with contextlib.suppress(OSError):
                (self.folder / f"{entry.id}{suffix}").unlink()

    def _refresh(self) -> None:
        """(Under the lock.) Read the records again if the folder changed: new ones in, gone ones out."""
        try:
            seen = self.folder.stat().st_mtime_ns
        except OSError:
            return
        if seen == self._seen:
            return
        self._seen = seen
        self._entries = dict(self._read_back())

    def _read_back(self) -> Iterator[tuple[str, GalleryEntry]]:
        """Every record that reads back whole: its id from its file name, its bytes and age from
        its files on disk. One that does not (a bad field, its file gone or leading out) is
        logged and left out, and its files with it: the bounds never act on what it says."""
        from_disk = {"created": 0.0, "bytes": 0}  # placeholders, replaced from the files below
        for entry_id, entry in stored.records_in(self.folder, GalleryEntry, suffix=".json", stem=ID,
                                                 identity=lambda stem: {"id": stem, **from_disk}):
            names = [f"{entry_id}{MEDIA[entry.kind][0]}"] + ([f"{entry_id}{THUMBNAIL}"] if entry.kind == "video" else [])
            files = [stored.confined_file(self.folder, name) for name in names]
            if files[0] is None:
                log.warning("the gallery record %s.json names no file kept beside it (%s); it is skipped",
                            entry_id, names[0])
                continue
            try:
                sizes = [os.stat(path).st_size for path in files if path is not None]
                created = os.stat(files[0]).st_mtime
            except OSError:
                continue
            yield entry_id, replace(entry, created=created, bytes=sum(sizes))

    def _clear_orphans(self) -> None:
        """Remove the files an interrupted write left without a record an hour ago or more."""
        cutoff = time.time() - ORPHAN_S
        for path in self.folder.iterdir():
            stem = path.name.lstrip(".").split(".")[0]
            if not ID.fullmatch(stem) or (self.folder / f"{stem}.json").exists():
                continue
            with contextlib.suppress(OSError):
                if path.lstat().st_mtime < cutoff:
                    path.unlink()


def _write(path: Path, content: bytes) -> None:
    """Write through a new temporary file and rename: a reader never sees half a file, and a
    name planted in the folder (a link) is replaced, never written through."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(content)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
