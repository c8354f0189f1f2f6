"""The HTTP API: FastAPI over one :class:`~engine.service.facade.Engine`.

Routes mirror the Python facade (families, images info / plan / load /
generate / status / unload, training info / start / status / stop / cancel / runs),
plus OpenAI-compatible ``POST /v1/images/generations``, ``/v1/images/edits`` and ``/v1/videos`` on the loaded
pipeline, so existing clients work unchanged. The web page is served at ``/``
(:mod:`engine.server.pages`), with listings of the roots and a run's files
(:mod:`engine.server.browse`) for it to pick from.

Every error, whatever its status, is JSON ``{"error": {"code", "message"}}``
(:mod:`engine.server.responses`): 400 for a request that cannot succeed here,
401 without the token, 404 for an unknown name, path or route, 405, 409 for a
busy engine or a missing prerequisite, 413 for a body over the cap, 422 for a
malformed body, 429 (with ``Retry-After``) when the generate queue is full,
500 ``internal_error`` for a failure nothing foresaw (logged on the server,
never sent). The token and the body cap are checked by an ASGI
middleware (:mod:`engine.server.guard`) before a byte of the body is read.
Model, dataset, LoRA and output paths are confined to the configured roots.

Generates go through one bounded FIFO queue (:mod:`engine.server.jobs`,
routes in :mod:`engine.server.job_routes`): ``POST /v1/images/jobs``
answers 202 with a job to follow (``GET``, ``DELETE``, SSE ``.../events``);
the synchronous generate routes queue a job and wait for it, so concurrent
clients queue rather than refuse each other; a full queue is 429 with
``Retry-After``. A waiting client that disconnects cancels its job (queued:
it never runs; running: it stops before the next block of its step). Shutting
down (Ctrl-C) cancels every job and waits for the worker before the process ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from engine import Engine, __version__
from engine.errors import EngineError
from engine.server import responses
from engine.server.browse import browse_router
from engine.server.confined import Confined
from engine.server.dataset_routes import UPLOAD_PATHS, datasets_router
from engine.server.guard import Guard
from engine.server.gallery_routes import gallery_router
from engine.server.image_routes import images_router, openai_images_router
from engine.server.model_routes import models_router
from engine.server.job_routes import EVENT_PATHS, jobs_router, queue_full
from engine.server.jobs import JobQueue, QueueFull
from engine.server.pages import PUBLIC_PATHS, PUBLIC_PREFIXES, add_pages
from engine.server.settings import ServerSettings, allowed_hosts
from engine.server.training_routes import training_router
from engine.server.video_routes import videos_router

__all__ = ["ServerSettings", "create_app"]

#: The routes whose POST takes a multipart upload (OpenAI's edits and videos, dataset images).
FORM_PATHS = re.compile(rf"/v1/images/edits|/v1/videos|{UPLOAD_PATHS.pattern}")


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


# -- the app -------------------------------------------------------------------


def guard_options(settings: ServerSettings, app: FastAPI | None = None) -> dict[str, Any]:
    """The :class:`Guard`'s settings for this server: its token, hosts and caps, and the paths
    that are public (``app``'s schema and docs; FastAPI's default paths without one). One
    place, so the single server and a replicated service's front refuse alike."""
    app = app or FastAPI()
    public = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url, *PUBLIC_PATHS} - {None}
    return dict(token=settings.token, max_body_bytes=settings.max_body_bytes, public_paths=public,
                public_prefixes=PUBLIC_PREFIXES, query_token_paths=EVENT_PATHS,
                allowed_hosts=allowed_hosts(settings), form_paths=FORM_PATHS,
                upload_paths=UPLOAD_PATHS, max_upload_bytes=settings.max_upload_bytes)


def create_app(engine: Engine, settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The app over ``engine``: its error bodies, the guard, the queue, and the routers."""
    queue: JobQueue | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if queue is not None:  # shutting down (Ctrl-C): the running job stops inside its step
            await asyncio.to_thread(queue.close)

    app = FastAPI(
        lifespan=lifespan,
        title="diffusion-engine",
        version=__version__,
        description="Run diffusion image models and train LoRA adapters, the fastest way this machine allows.",
        responses={code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 415, 422, 429, 500)},
    )
    app.add_exception_handler(EngineError, responses.engine_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, responses.validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, responses.http_error)  # type: ignore[arg-type]
    app.add_exception_handler(QueueFull, queue_full)  # type: ignore[arg-type]
    app.add_middleware(Guard, **guard_options(settings, app))  # type: ignore[arg-type]
    # Every output is kept with its recipe under the outputs root, within the operator's bounds.
    gallery = (engine.open_gallery(settings.output_roots[0] / "gallery", **settings.gallery_limits)  # type: ignore[arg-type]
               if settings.output_roots else None)
    queue = JobQueue(engine, size=settings.queue_size, owner=settings.replica, gallery=gallery)
    if settings.keep_alive_s is not None:  # an idle model goes after this long
        engine.images.keep_alive.seconds = settings.keep_alive_s
    confined = Confined(engine, settings)
    api = APIRouter(prefix="/v1")

    @api.get("/families")
    def families() -> list[dict[str, Any]]:
        return engine.catalog.families()

    app.include_router(api)
    app.include_router(images_router(engine, confined, queue))
    app.include_router(openai_images_router(engine, confined, queue))
    app.include_router(gallery_router(gallery))
    app.include_router(training_router(engine, confined))
    app.include_router(models_router(engine, confined))
    app.include_router(videos_router(engine, confined, queue))
    app.include_router(jobs_router(queue, engine, confined.generate))
    app.include_router(browse_router(engine, settings))
    app.include_router(datasets_router(engine, settings))
    add_pages(app, token_required=settings.token is not None)
    return app

