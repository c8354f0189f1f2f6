"""Images served by URL: OpenAI's ``response_format=url``.

The OpenAI images API can answer with URLs instead of inline base64. The
server keeps each such image as a PNG in ``images/`` under its outputs root,
named by a random 128-bit hex id, and serves it at ``/v1/images/files/{name}``
under the same token rule as every route (the bearer header). Names are
checked against that one shape, so a request can never name another file.

They are kept ``keep_seconds`` (``serve --keep-url-images SECONDS``; 3600 by
default, as long as OpenAI keeps its own image URLs), then removed: an expired
name is a 404 (and goes when it is asked for), and every keep sweeps what has
expired, so the folder never grows past an hour's images.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import stat
import time
from pathlib import Path

from engine.errors import EngineError
from engine.server.settings import KEEP_URL_IMAGES_S

NAME = re.compile(r"[0-9a-f]{32}\.png")


class ImageNotFound(EngineError):
    """No hosted image of that name (a 404)."""

    code = "image_not_found"


class HostedImages:
    """PNGs kept for URL answers in ``folder`` (None: the server has no outputs root)."""

    def __init__(self, folder: Path | None, keep_seconds: float = KEEP_URL_IMAGES_S) -> None:
        self.folder = folder
        self.keep_seconds = keep_seconds

    def keep(self, images: list[str]) -> list[str]:
        """Write each base64 PNG; their names, in order."""
        if self.folder is None:
            raise EngineError("response_format=url needs an outputs root to keep the images in (serve --outputs DIR); "
                              "use response_format=b64_json", code="invalid_request")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sweep()
        names = []
        for image in images:
            name = f"{secrets.token_hex(16)}.png"
            temporary = self.folder / f".{name}.tmp"
            temporary.write_bytes(base64.b64decode(image))
            os.replace(temporary, self.folder / name)
            names.append(name)
        return names

    def read(self, name: str) -> bytes:
        path = self.folder / name if self.folder is not None and NAME.fullmatch(name) else None
        if path is not None and self._expired(path):
            with contextlib.suppress(OSError):
                path.unlink()
        if path is None or not path.is_file():
            raise ImageNotFound(f"no image {name[:80]!r} is kept here (URL images are kept "
                                f"{self.keep_seconds:g} s); its URL came from a response_format=url call",
                                code="image_not_found")
        return path.read_bytes()

    def sweep(self) -> int:
        """Remove the images kept longer than ``keep_seconds`` (and abandoned partial writes);
        how many went."""
        if self.folder is None:
            return 0
        removed = 0
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return 0
        for entry in entries:
            if (NAME.fullmatch(entry.name) or entry.name.endswith(".png.tmp")) and self._expired(Path(entry.path)):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def _expired(self, path: Path) -> bool:
        """A plain file kept longer than ``keep_seconds`` (a missing one is not: it is just gone)."""
        try:
            info = path.lstat()
        except OSError:
            return False
        return stat.S_ISREG(info.st_mode) and info.st_mtime < time.time() - self.keep_seconds
