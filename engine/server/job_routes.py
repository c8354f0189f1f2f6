"""The job routes: queue a generate, follow it, cancel it; the event streams.

``POST /v1/images/jobs`` (the body of ``/v1/images/generate``) answers 202
with the job's JSON at once (see :mod:`engine.server.jobs` for its shape and
states); ``GET /v1/images/jobs/{id}`` gives it again, with its images once
done; ``DELETE /v1/images/jobs/{id}`` cancels it (a queued job never runs; a
running one stops before the next block of its step) and answers its JSON; ``GET
/v1/images/jobs`` lists the queue and the kept jobs (newest first, without
images). The event streams are in :mod:`engine.server.events`.

A full queue answers 429 ``queue_full`` with a ``Retry-After`` header (seconds).
The synchronous routes (``/v1/images/generate``, the OpenAI-compatible
``/v1/images/generations`` and ``/v1/images/edits``) queue a job too and
wait for it (:func:`run_job`); their client going away (its timeout, a
closed connection) cancels the job, queued or running. Their answers carry
the job's id in the ``X-Job-Id`` header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from engine.errors import EngineError
from engine.server import responses
from engine.requests import GenerateBody
from engine.server.events import event_stream, job_events, training_events
from engine.server.jobs import Job, JobQueue, QueueFull

__all__ = ["EVENT_PATHS", "jobs_router", "queue_full", "run_job"]

#: Seconds between checks that a waiting client is still connected.
DISCONNECT_POLL_S = 0.25
#: The routes that also take the token as ``?token=`` (``EventSource`` cannot send headers).
EVENT_PATHS = re.compile(r"/v1/images/jobs/[^/]+/events|/v1/videos/[^/]+/events|/v1/training/events")


def jobs_router(queue: JobQueue, engine: Any, prepare: Callable[[GenerateBody], GenerateBody]) -> APIRouter:
    """The routes over ``queue``; ``prepare(body)`` is the body with its paths confined
    to the server's roots (blocking: it reads image headers)."""
    api = APIRouter(prefix="/v1")

    @api.post("/images/jobs", status_code=202)
    async def submit(body: GenerateBody) -> dict[str, Any]:
        job = await run_in_threadpool(lambda: queue.submit(prepare(body)))  # a named model is judged here
        return job.to_dict()

    @api.get("/images/jobs")
    def listing() -> dict[str, Any]:
        return {"queue": queue.status(), "jobs": [job.to_dict(images=False) for job in queue.jobs()]}

    @api.get("/images/jobs/{job_id}")
    def get(job_id: str) -> dict[str, Any]:
        return queue.get(job_id).to_dict()

    @api.delete("/images/jobs/{job_id}")
    def cancel(job_id: str) -> dict[str, Any]:
        return queue.cancel(job_id).to_dict(images=False)

    @api.get("/images/jobs/{job_id}/events", response_class=Response)
    def job_stream(job_id: str) -> Response:
        """SSE: ``queued`` (position), ``running``, ``step``, then ``done`` / ``failed`` / ``cancelled``."""
        return event_stream(job_events(queue.get(job_id)))

    @api.get("/training/events", response_class=Response)
    def training_stream() -> Response:
        """SSE: ``state`` on every change of the run's state, ``step`` (loss, lr) on every step."""
        return event_stream(training_events(engine.training.status))

    return api


async def run_job(queue: JobQueue, request: Request, response: Response, body: GenerateBody,
                  inputs: Mapping[str, bytes | list[bytes]] | None = None) -> Job:
    """Queue a generate and wait for it: the finished job (its PNGs in ``images``, base64, and
    its gallery entries), or its error raised. The client going away cancels the job, queued
    or running. The kept record drops the PNGs once they are handed over."""
    job = await run_in_threadpool(queue.submit, body, inputs)  # a named model is judged here, off the loop
    response.headers["X-Job-Id"] = job.id
    watcher = asyncio.create_task(_watch_disconnect(request, queue, job))
    try:
        while not job.finished_state:
            seen = job.signal.version
            if job.finished_state:
                break
            await job.signal.wait(seen, 30.0)
    finally:
        if not job.finished_state:  # this request's task was cancelled: stop its job too
            queue.cancel(job.id)
        watcher.cancel()
    if job.state == "done":
        done = dataclasses.replace(job)  # the caller's copy, with the PNGs
        queue.drop_result(job)  # delivered: the kept record need not hold the PNGs
        return done
    raise job.error or EngineError(f"the job ended {job.state}", code="internal_error")


async def queue_full(_: Request, error: QueueFull) -> JSONResponse:
    return responses.error_response(429, error.code, error.message, headers={"Retry-After": str(error.retry_after)})


async def _watch_disconnect(request: Request, queue: JobQueue, job: Job) -> None:
    """Cancel ``job`` once its client has gone; the engine stops before its next block."""
    while not job.finished_state:
        if await request.is_disconnected():
            queue.cancel(job.id)
            return
        await asyncio.sleep(DISCONNECT_POLL_S)

