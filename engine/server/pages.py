"""The web page: ``/`` and its static files, served by ``serve`` beside the API.

The page (``engine/server/web/``: one HTML file, seven plain scripts loaded
in order, one style sheet; no framework, no CDN, no build step) holds no data: everything it
shows comes from the ``/v1`` routes, which it calls with the token the
person signed in with (kept in the browser's ``sessionStorage``, sent as
``Authorization: Bearer``). So ``/`` and ``/static/...`` are served
without the token (:data:`PUBLIC_PATHS`, :data:`PUBLIC_PREFIXES`, let
through by :class:`~engine.server.guard.Guard`), and every API call still
needs it: a browser that has not signed in sees the sign-in form and
nothing else.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

#: The page's files, shipped as package data.
WEB = Path(__file__).resolve().parent / "web"
#: Exact paths the guard serves without the token.
PUBLIC_PATHS = frozenset({"/"})
#: Path prefixes the guard serves without the token: the page's static files only.
PUBLIC_PREFIXES = ("/static/",)
#: The page changes with the package; a browser revalidates rather than guessing.
_HEADERS = {"Cache-Control": "no-cache"}


def add_pages(app: FastAPI, *, token_required: bool) -> None:
    """Serve the page at ``/`` and its files under ``/static/``.

    ``token_required`` is written into the page, so it asks for the token
    before its first call instead of provoking a 401 (a 401 says the same
    to anyone, so this reveals nothing)."""
    app.mount("/static", _NoCacheFiles(directory=WEB), name="static")
    page = (WEB / "index.html").read_text(encoding="utf-8").replace(
        '<meta name="token-required" content="">',
        f'<meta name="token-required" content="{"yes" if token_required else "no"}">',
    )

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(page, headers=_HEADERS)


class _NoCacheFiles(StaticFiles):
    """Static files a browser revalidates (ETag) instead of caching a stale script."""

    def file_response(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
        response = super().file_response(*args, **kwargs)  # type: ignore[arg-type]
        response.headers.update(_HEADERS)
        return response
