"""The image routes: info, plan, load, generate, cancel, status, unload, and
OpenAI's generations and edits.

Generates queue a job on the server's one :class:`~engine.server.jobs.JobQueue`
and wait for it (:func:`~engine.server.job_routes.run_job`), so concurrent
clients queue rather than refuse each other; a client that disconnects
cancels its job. Paths are confined by :class:`~engine.server.confined.Confined`.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from engine import Engine
from engine.requests import GenerateBody, LoadBody, PlanBody
from engine.server.bodies import OpenAIImagesBody
from engine.server.confined import Confined
from engine.server.edits import read_edit_form
from engine.errors import EngineError
from engine.server.job_routes import run_job
from engine.server.jobs import Job, JobQueue


def images_router(engine: Engine, confined: Confined, queue: JobQueue) -> APIRouter:
    api = APIRouter(prefix="/v1/images")

    @api.get("/info")
    def images_info() -> dict[str, Any]:
        return engine.images.info()  # torch-free: tables and the light probe only

    @api.post("/plan")
    def plan(body: PlanBody) -> dict[str, Any]:
        result = engine.images.plan(
            confined.optional_model(body.model), family=body.family, checkpoint=body.checkpoint,
            base=confined.optional_model(body.base), request=body.request(),
            controlnet=confined.controlnet(body.controlnet),
        )
        return result.to_dict()

    @api.post("/load")
    def load(body: LoadBody) -> dict[str, Any]:
        return engine.images.load(
            confined.model(body.model), base=confined.optional_model(body.base), family=body.family,
            request=body.request(), loras=confined.loras(body.loras) or [], switching=body.lora_switching,
            controlnet=confined.controlnet(body.controlnet),
        )

    @api.post("/generate")
    async def generate(body: GenerateBody, request: Request, response: Response) -> dict[str, Any]:
        """Queue the generate and wait for it; the wait in the queue counts in ``seconds``."""
        started = time.perf_counter()
        job = await run_job(queue, request, response, await run_in_threadpool(confined.generate, body))
        return {"images": job.images, "gallery": job.gallery, "seconds": round(time.perf_counter() - started, 3)}

    @api.delete("/generate")
    def cancel_generate() -> dict[str, Any]:
        """Stop the running generate before the next block of its step (its caller gets code ``cancelled``);
        the jobs queued behind it still run (``DELETE /v1/images/jobs/{id}`` cancels one job)."""
        return {"cancelled": engine.images.cancel()}

    @api.get("/status")
    def status() -> dict[str, Any]:
        """The engine's status, the running (else latest) job's progress, and the queue."""
        return {**engine.status(), "generate": queue.progress(), "queue": queue.status()}

    @api.post("/unload")
    def unload() -> dict[str, Any]:
        return {"unloaded": engine.images.unload()}

    return api


def openai_images_router(engine: Engine, confined: Confined, queue: JobQueue) -> APIRouter:
    """OpenAI's ``/v1/images/generations`` and ``/v1/images/edits``, so existing clients work
    unchanged; a ``response_format=url`` answer points at the gallery's files."""
    api = APIRouter(prefix="/v1/images")

    @api.post("/generations")
    async def openai_images(body: OpenAIImagesBody, request: Request, response: Response) -> dict[str, Any]:
        """OpenAI's image generation; queued like every generate, the client's timeout
        (a closed connection) cancelling its job."""
        width, height = body.dimensions()
        if body.response_format == "url":
            _check_gallery(queue)
        job = await run_job(queue, request, response, await run_in_threadpool(confined.generate, GenerateBody(
            prompt=body.prompt, model=body.model, count=body.n, width=width, height=height,
            seed=secrets.randbelow(2**31), loras=body.loras, keep_alive=body.keep_alive,
        )))
        return {"created": int(time.time()), "data": openai_data(job, body.response_format, request)}

    def openai_data(job: Job, response_format: str, request: Request) -> list[dict[str, str]]:
        """OpenAI's ``data``: each image inline (``b64_json``), or the URL of its gallery entry's
        file (``url``; fetched with the token, as every route; kept within the gallery's bounds)."""
        if response_format == "b64_json":
            return [{"b64_json": image} for image in job.images]
        if len(job.gallery) != len(job.images):
            raise EngineError("the images could not be kept in the gallery (see the server's log); "
                              "use response_format=b64_json", code="internal_error")
        return [{"url": str(request.url_for("gallery_file", entry_id=entry))} for entry in job.gallery]

    @api.post("/edits")
    async def openai_edits(request: Request, response: Response) -> dict[str, Any]:
        """OpenAI's image edit: multipart ``image`` (+ ``mask``): an instruction
        edit on an edit checkpoint, inpaint with a mask, img2img otherwise."""
        form = await read_edit_form(request)
        width, height = form.body.dimensions() if form.sized else (None, None)
        inputs = {"image": form.image} if form.mask is None else {"image": form.image, "mask_image": form.mask}
        if form.body.response_format == "url":
            _check_gallery(queue)
        job = await run_job(queue, request, response, await run_in_threadpool(confined.generate, GenerateBody(
            prompt=form.body.prompt, model=form.body.model, count=form.body.n, width=width, height=height,
            seed=secrets.randbelow(2**31),
        )), inputs)
        return {"created": int(time.time()), "data": openai_data(job, form.body.response_format, request)}

    return api


def _check_gallery(queue: JobQueue) -> None:
    """``response_format=url`` answers from the gallery: refused before anything runs without one."""
    if queue.gallery is None:
        raise EngineError("response_format=url answers from the gallery, which this server keeps under its "
                          "outputs folder (serve --outputs DIR); use response_format=b64_json", code="no_gallery")
