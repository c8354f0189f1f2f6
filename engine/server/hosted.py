"""Images served by URL: OpenAI's ``response_format=url``.

The OpenAI images API can answer with URLs instead of inline base64. The
server keeps each such image as a PNG in ``images/`` under its outputs root,
named by a random 128-bit hex id, and serves it at ``/v1/images/files/{name}``
under the same token rule as every route (the bearer header). Names are
checked against that one shape, so a request can never name another file.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
from pathlib import Path

from engine.errors import EngineError

NAME = re.compile(r"[0-9a-f]{32}\.png")


class ImageNotFound(EngineError):
    """No hosted image of that name (a 404)."""

    code = "image_not_found"


class HostedImages:
    """PNGs kept for URL answers in ``folder`` (None: the server has no outputs root)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def keep(self, images: list[str]) -> list[str]:
        """Write each base64 PNG; their names, in order."""
        if self.folder is None:
            raise EngineError("response_format=url needs an outputs root to keep the images in (serve --outputs DIR); "
                              "use response_format=b64_json", code="invalid_request")
        self.folder.mkdir(parents=True, exist_ok=True)
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
        if path is None or not path.is_file():
            raise ImageNotFound(f"no image {name[:80]!r} is kept here; its URL came from a response_format=url call",
                                code="image_not_found")
        return path.read_bytes()
