"""The OpenAI-compatible ``POST /v1/images/edits`` form: multipart, read and checked.

OpenAI clients upload the image (and an optional mask) as multipart files,
with ``prompt``, ``n``, ``size`` and ``response_format`` as form fields. The
whole body is capped by the server's body limit before a byte is read
(:mod:`engine.server.guard`), so an upload can never exceed it; the scalar
fields are held to the same limits as ``/v1/images/generations``
(:class:`~engine.server.bodies.OpenAIImagesBody`). OpenAI's mask marks the
area to edit by full transparency; it becomes the engine's mask (white where
redrawn). A mask without transparency is taken as the engine's own.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from PIL import Image, UnidentifiedImageError
from pydantic import ValidationError

from engine.errors import EngineError
from engine.server.bodies import OpenAIImagesBody


@dataclass(frozen=True)
class EditForm:
    body: OpenAIImagesBody
    image: bytes
    mask: Image.Image | None
    #: Whether the client sent ``size``; without it the output keeps the input's size.
    sized: bool


async def read_edit_form(request: Request) -> EditForm:
    """The edit request in ``request``'s multipart body, or a 422 / 400 naming the field."""
    try:
        form = await request.form(max_files=2, max_fields=20)
    except (AssertionError, ValueError) as exc:  # starlette: no multipart parser, or a malformed body
        raise EngineError(f"the edit request must be multipart/form-data ({exc})", code="invalid_request") from exc
    image = form.get("image") or form.get("image[]")
    if image is None or isinstance(image, str):
        raise RequestValidationError([{"type": "missing", "loc": ("body", "image"), "msg": "Field required", "input": None}])
    fields: dict[str, Any] = {k: v for k, v in form.items() if isinstance(v, str) and k in ("prompt", "size", "response_format", "model")}
    if "n" in form:
        try:
            fields["n"] = int(str(form["n"]))
        except ValueError:
            fields["n"] = str(form["n"])  # refused by the model below, naming n
    try:
        body = OpenAIImagesBody.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    mask_file = form.get("mask")
    mask = None
    if mask_file is not None and not isinstance(mask_file, str):
        mask = _engine_mask(await mask_file.read())
    return EditForm(body, await image.read(), mask, "size" in fields)


def _engine_mask(data: bytes) -> Image.Image:
    try:
        mask = Image.open(io.BytesIO(data))
        mask.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise EngineError(f"mask: the upload is not a readable image ({exc}); send a PNG", code="invalid_image") from None
    if "A" in mask.getbands():
        return mask.getchannel("A").point(lambda alpha: 255 if alpha == 0 else 0)
    return mask.convert("L")
