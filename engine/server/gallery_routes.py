"""The gallery over HTTP: list and page it, one entry, its file, pin, delete.

Every output a generate job makes (images and clips, every route) is kept in the gallery
under the outputs root with its recipe (:mod:`engine.service.gallery`); OpenAI's
``response_format=url`` answers with its entries' file URLs. Entries are named by their id
only (32 hex digits), so a request can never name another file. A server started without an
outputs root keeps no gallery: these routes answer 409 ``no_gallery``.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from engine.errors import EngineError
from engine.requests import Body

#: What a listing may filter by.
Kinds = Literal["image", "video"]


class PinBody(Body):
    pinned: bool = True


def gallery_router(gallery: Any) -> APIRouter:
    """The routes over ``gallery`` (``engine.open_gallery``; None: the server keeps none)."""
    api = APIRouter(prefix="/v1")

    def kept() -> Any:
        if gallery is None:
            raise EngineError("this server keeps no gallery: it was started without an outputs folder "
                              "(serve --outputs DIR)", code="no_gallery")
        return gallery

    @api.get("/gallery")
    def listing(offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=200), kind: Kinds | None = None,
                pinned: bool | None = None) -> dict[str, Any]:
        """A page of entries, newest first, with ``total``, ``next_offset`` and the bounds."""
        return kept().page(offset=offset, limit=limit, kind=kind, pinned=pinned)  # type: ignore[no-any-return]

    @api.get("/gallery/{entry_id}")
    def entry(entry_id: str) -> dict[str, Any]:
        """One entry: its kind, size, pin, job and recipe (the request as it ran, what engaged)."""
        return kept().get(entry_id).to_dict()  # type: ignore[no-any-return]

    @api.get("/gallery/{entry_id}/file", name="gallery_file")
    def entry_file(entry_id: str, variant: Literal["file", "thumbnail"] = "file") -> FileResponse:
        """The entry's PNG or MP4 (``variant=thumbnail``: a clip's first frame, PNG)."""
        path, media_type = kept().file(entry_id, variant)
        return FileResponse(path, media_type=media_type)

    @api.post("/gallery/{entry_id}/pin")
    def pin(entry_id: str, body: PinBody) -> dict[str, Any]:
        """Pin an entry (the bounds never remove it), or unpin it with ``{"pinned": false}``."""
        return kept().pin(entry_id, body.pinned).to_dict()  # type: ignore[no-any-return]

    @api.delete("/gallery/{entry_id}")
    def delete(entry_id: str) -> dict[str, Any]:
        """Remove an entry and its files, pinned or not."""
        return {"id": kept().delete(entry_id).id, "deleted": True}

    @api.get("/images/files/{name}")
    def url_image(name: str) -> FileResponse:
        """An image by the name an earlier ``response_format=url`` answer gave (``ID.png``): its entry's file."""
        path, media_type = kept().file(name.removesuffix(".png"))
        return FileResponse(path, media_type=media_type)

    return api
