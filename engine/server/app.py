"""The HTTP API: FastAPI over one :class:`~engine.service.facade.Engine`.

Routes mirror the Python facade (families, images info / plan / load /
generate / status / unload, training info / start / status / stop / cancel / runs),
plus OpenAI-compatible ``POST /v1/images/generations`` and ``/v1/images/edits`` on the loaded
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
it never runs; running: it stops at the next step).
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from engine import __version__
from engine.errors import EngineError
from engine.server import responses
from engine.requests import GenerateBody, LoadBody, LoraBody, PlanBody
from engine.server.bodies import OpenAIImagesBody, StopBody, TrainingStartBody
from engine.server.browse import browse_router
from engine.server.dataset_routes import UPLOAD_PATHS, datasets_router
from engine.server.edits import read_edit_form
from engine.server.guard import Guard
from engine.server.hosted import HostedImages
from engine.server.job_routes import EVENT_PATHS, jobs_router, queue_full, run_job
from engine.server.jobs import JobQueue, QueueFull
from engine.server.pages import PUBLIC_PATHS, PUBLIC_PREFIXES, add_pages
from engine.server.paths import confine, confine_model
from engine.server.settings import ServerSettings, allowed_hosts
from engine import Engine

__all__ = ["ServerSettings", "create_app"]

#: The routes whose POST takes a multipart upload (OpenAI's edits, dataset images).
FORM_PATHS = re.compile(rf"/v1/images/edits|{UPLOAD_PATHS.pattern}")

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
    app = FastAPI(
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
    queue = JobQueue(engine, size=settings.queue_size, owner=settings.replica)
    hosted = HostedImages(settings.output_roots[0] / "images" if settings.output_roots else None,
                          keep_seconds=settings.keep_url_images_s)
    api = APIRouter(prefix="/v1")

    checkpoint_names = frozenset(str(name).lower() for family in engine.catalog.families()
                                 for name in family["checkpoints"])  # type: ignore[attr-defined]

    def model_path(value: str) -> str:
        return confine_model(value, settings.model_roots, allow_hub=settings.allow_hub,
                             checkpoint_names=checkpoint_names)

    def lora_paths(bodies: list[LoraBody] | None) -> list[dict[str, object]] | None:
        if bodies is None:
            return None
        return [{"path": str(confine(b.path, settings.lora_roots, "LoRA")), "scale": b.scale} for b in bodies]

    def controlnet_path(value: str | None) -> str | None:
        return str(confine(value, settings.model_roots, "ControlNet")) if value else None

    @api.get("/families")
    def families() -> list[dict[str, Any]]:
        return engine.catalog.families()

    @api.get("/images/info")
    def images_info() -> dict[str, Any]:
        return engine.images.info()  # torch-free: tables and the light probe only

    @api.post("/images/plan")
    def plan(body: PlanBody) -> dict[str, Any]:
        model = model_path(body.model) if body.model else None
        base = model_path(body.base) if body.base else None
        result = engine.images.plan(model, family=body.family, checkpoint=body.checkpoint, base=base, request=body.request(),
                             controlnet=controlnet_path(body.controlnet))
        return result.to_dict()

    @api.post("/images/load")
    def load(body: LoadBody) -> dict[str, Any]:
        base = model_path(body.base) if body.base else None
        return engine.images.load(
            model_path(body.model), base=base, family=body.family, request=body.request(),
            loras=lora_paths(body.loras) or [], switching=body.lora_switching,
            controlnet=controlnet_path(body.controlnet),
        )

    def input_paths(options: dict[str, Any]) -> dict[str, Any]:
        """Image paths confined to the input roots and sized from their headers
        (a bomb is refused before it is queued or decoded); unset lists dropped."""
        for name in ("image", "mask_image", "control_image"):
            if options.get(name) is not None:
                options[name] = str(confine(options[name], settings.input_roots, "input image"))
                engine.images.check_image(options[name], name)
        return {k: v for k, v in options.items() if not (k in ("seeds", "prompts", "batch") and v is None)}

    def prepare(body: GenerateBody) -> dict[str, Any]:
        """A generate body as the engine's options, its paths confined (blocking: run it off the loop)."""
        return {**input_paths(body.model_dump(exclude={"prompt", "loras"})), "loras": lora_paths(body.loras)}

    @api.post("/images/generate")
    async def generate(body: GenerateBody, request: Request, response: Response) -> dict[str, Any]:
        """Queue the generate and wait for it; the wait in the queue counts in ``seconds``."""
        started = time.perf_counter()
        options = await run_in_threadpool(prepare, body)
        images = await run_job(queue, request, response, body.prompt, options)
        return {"images": images, "seconds": round(time.perf_counter() - started, 3)}

    @api.delete("/images/generate")
    def cancel_generate() -> dict[str, Any]:
        """Stop the running generate after its current step (its caller gets code ``cancelled``);
        the jobs queued behind it still run (``DELETE /v1/images/jobs/{id}`` cancels one job)."""
        return {"cancelled": engine.images.cancel()}

    @api.get("/images/status")
    def status() -> dict[str, Any]:
        """The engine's status, the running (else latest) job's progress, and the queue."""
        return {**engine.status(), "generate": queue.progress(), "queue": queue.status()}

    @api.post("/images/unload")
    def unload() -> dict[str, Any]:
        return {"unloaded": engine.images.unload()}

    @api.post("/images/generations")
    async def openai_images(body: OpenAIImagesBody, request: Request, response: Response) -> dict[str, Any]:
        """OpenAI's image generation; queued like every generate, the client's timeout
        (a closed connection) cancelling its job."""
        width, height = body.dimensions()
        loras = await run_in_threadpool(lora_paths, body.loras)
        images = await run_job(queue, request, response, body.prompt, dict(
            count=body.n, width=width, height=height, seed=secrets.randbelow(2**31), loras=loras,
        ))
        return {"created": int(time.time()), "data": await openai_data(images, body.response_format, request)}

    async def openai_data(images: list[str], response_format: str, request: Request) -> list[dict[str, str]]:
        """OpenAI's ``data``: each image inline (``b64_json``), or kept under the outputs root and
        given as a URL this server serves (``url``; fetched with the token, as every route)."""
        if response_format == "b64_json":
            return [{"b64_json": image} for image in images]
        names = await run_in_threadpool(hosted.keep, images)
        return [{"url": str(request.url_for("hosted_image", name=name))} for name in names]

    @api.post("/images/edits")
    async def openai_edits(request: Request, response: Response) -> dict[str, Any]:
        """OpenAI's image edit: multipart ``image`` (+ ``mask``): an instruction
        edit on an edit checkpoint, inpaint with a mask, img2img otherwise."""
        form = await read_edit_form(request)
        await run_in_threadpool(form.check, engine)
        width, height = form.body.dimensions() if form.sized else (None, None)
        images = await run_job(queue, request, response, form.body.prompt, dict(
            count=form.body.n, width=width, height=height, seed=secrets.randbelow(2**31),
            image=form.image, mask_image=form.mask,
        ))
        return {"created": int(time.time()), "data": await openai_data(images, form.body.response_format, request)}

    @api.get("/images/files/{name}", name="hosted_image")
    def hosted_image(name: str) -> Response:
        """An image a ``response_format=url`` call kept (PNG), by the name its URL gave."""
        return Response(hosted.read(name), media_type="image/png")

    @api.get("/training/info")
    def training_info(device: str = "auto") -> dict[str, Any]:
        """Per family, the base precisions a run offers on ``device`` (auto, cuda, cpu), the others with why."""
        return engine.training.info(device=device)

    def training_config(body: TrainingStartBody) -> Any:
        confined: dict[str, Any] = {
            "base_model": model_path(body.base_model),
            "dataset_dir": confine(str(body.dataset_dir), settings.dataset_roots, "dataset"),
        }
        if body.output_dir is not None:
            confined["output_dir"] = confine(str(body.output_dir), settings.output_roots, "output")
        if body.resume_from is not None:  # a checkpoint of a run: runs live under the output roots
            confined["resume_from"] = confine(str(body.resume_from), settings.output_roots, "output")
        return body.config(**confined)

    @api.post("/training/start")
    def start_training(body: TrainingStartBody) -> dict[str, Any]:
        return engine.training.start(training_config(body), resume=body.resume)

    @api.post("/training/plan")
    def plan_training(body: TrainingStartBody) -> dict[str, Any]:
        """The dry run: every check a start makes (memory, dataset, precision), loading and evicting nothing."""
        return engine.training.plan(training_config(body)).to_dict()

    @api.get("/training/status")
    def training_status() -> dict[str, Any]:
        return engine.training.status() or {"status": "idle"}

    @api.post("/training/stop")
    def stop_training(body: StopBody) -> dict[str, Any]:
        return engine.training.stop(save=body.save, now=body.now)

    @api.post("/training/cancel")
    def cancel_training() -> dict[str, Any]:
        return engine.training.cancel()

    @api.get("/training/runs")
    def runs() -> list[dict[str, Any]]:
        return engine.training.runs()

    app.include_router(api)
    app.include_router(jobs_router(queue, engine, prepare))
    app.include_router(browse_router(engine, settings))
    app.include_router(datasets_router(engine, settings))
    add_pages(app, token_required=settings.token is not None)
    return app

