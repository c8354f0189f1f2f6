"""``/v1/datasets``: the web page's dataset manager over HTTP.

Thin: each route turns its path, query or body into one call of the
engine's dataset methods (:mod:`engine.service.datasets`), in the server's
dataset roots (``serve --datasets``). Uploads are multipart (field
``files``, one or more images), capped by the server's upload limit before a
byte is read (:mod:`engine.server.guard`); captions are JSON
``{"caption": "..."}`` (an empty one clears it). A dataset a training run
is using answers 409 ``dataset_in_use`` to every change.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from engine import Engine
from engine.errors import EngineError
from engine.requests import Body
from engine.server.settings import ServerSettings

#: The route that takes a multipart upload (for the guard).
UPLOAD_PATHS = re.compile(r"/v1/datasets/[^/]+/images")
#: Files one upload may carry.
MAX_UPLOAD_FILES = 64
#: A caption's longest form (characters).
MAX_CAPTION = 4000


class CaptionBody(Body):
    #: The caption to train with; empty clears it.
    caption: str = Field(max_length=MAX_CAPTION)


def datasets_router(engine: Engine, settings: ServerSettings) -> APIRouter:
    api = APIRouter(prefix="/v1/datasets")
    roots = settings.dataset_roots

    @api.get("")
    def datasets() -> list[dict[str, Any]]:
        """Every dataset under the roots: images, captioned images, and the run using it (if any)."""
        return engine.datasets.list(roots=roots)

    @api.get("/{name}")
    def dataset(name: str) -> dict[str, Any]:
        """One dataset's images with the caption a run trains with and where it comes from."""
        return engine.datasets.get(name, roots=roots)

    @api.get("/{name}/thumbnails/{image:path}")
    def thumbnail(name: str, image: str, size: int = 256) -> Response:
        """A PNG of the image, at most ``size`` px a side."""
        return Response(engine.datasets.thumbnail(name, image, size, roots=roots), media_type="image/png")

    @api.post("/{name}/images", status_code=201)
    async def upload(name: str, request: Request) -> dict[str, Any]:
        """Add images (multipart field ``files``); a name already there is 409 ``image_exists``."""
        try:
            form = await request.form(max_files=MAX_UPLOAD_FILES, max_fields=MAX_UPLOAD_FILES + 4)
        except (AssertionError, ValueError) as exc:
            raise EngineError(f"the upload must be multipart/form-data with files ({exc})",
                              code="invalid_request") from exc
        files = [(upload.filename or "", await upload.read())
                 for upload in form.getlist("files") if not isinstance(upload, str)]
        return await run_in_threadpool(engine.datasets.add_images, name, files, roots=roots)

    @api.put("/{name}/captions/{image:path}")
    def caption(name: str, image: str, body: CaptionBody) -> dict[str, Any]:
        """Write the image's caption (``""`` clears it)."""
        return engine.datasets.set_caption(name, image, body.caption, roots=roots)

    @api.delete("/{name}/images/{image:path}")
    def remove(name: str, image: str) -> dict[str, Any]:
        """Delete the image with its caption."""
        return engine.datasets.remove_image(name, image, roots=roots)

    return api
