"""The OpenAI-compatible ``POST /v1/images/edits`` form: multipart, read and checked.

OpenAI clients upload the image (and an optional mask) as multipart files,
with ``prompt``, ``n``, ``size`` and ``response_format`` as form fields. The
whole body is capped by the server's body limit before a byte is read
(:mod:`engine.server.guard`), so an upload can never exceed it; the scalar
fields are held to the same limits as ``/v1/images/generations``
(:class:`~engine.server.bodies.OpenAIImagesBody`). Both uploads are sized
from their headers by the engine (the job's ticket, ``engine.images.check_generate``: a bomb
is refused before a pixel is decoded) and decoded only by the generate job, in the
queue, like every other input. OpenAI's mask marks the area to edit by full
transparency, which the engine's mask reader honours
(:func:`engine.runtime.inputs.read_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from engine.errors import EngineError
from engine.requests.bodies import MAX_INPUT_IMAGES
from engine.server.bodies import OpenAIImagesBody


@dataclass(frozen=True)
class EditForm:
    body: OpenAIImagesBody
    #: The uploaded image, or several (OpenAI's repeated ``image[]``: a multi-image edit).
    image: bytes | list[bytes]
    mask: bytes | None
    #: Whether the client sent ``size``; without it the output keeps the input's size.
    sized: bool


async def read_edit_form(request: Request) -> EditForm:
    """The edit request in ``request``'s multipart body, or a 422 / 400 naming the field."""
    try:
        form = await request.form(max_files=1 + MAX_INPUT_IMAGES, max_fields=20)
    except (AssertionError, ValueError) as exc:  # starlette: no multipart parser, or a malformed body
        raise EngineError(f"the edit request must be multipart/form-data ({exc})", code="invalid_request") from exc
    uploads = [v for key in ("image", "image[]") for v in form.getlist(key) if not isinstance(v, str)]
    if not uploads:
        raise RequestValidationError([{"type": "missing", "loc": ("body", "image"), "msg": "Field required", "input": None}])
    if len(uploads) > MAX_INPUT_IMAGES:
        raise EngineError(f"{len(uploads)} images were uploaded; an edit takes at most {MAX_INPUT_IMAGES}",
                          code="too_many_images")
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
    mask = await mask_file.read() if mask_file is not None and not isinstance(mask_file, str) else None
    images = [await upload.read() for upload in uploads]
    return EditForm(body, images[0] if len(images) == 1 else images, mask, "size" in fields)
