"""OpenAI's videos API on the loaded video model: create, retrieve, download, list, delete.

``POST /v1/videos`` takes OpenAI's multipart form (``prompt``, ``model``,
``seconds``, ``size`` as ``WxH``, an optional ``input_reference`` image for
image to video) plus the engine's own fields (``frames``, ``fps``, ``steps``,
``seed``, ``guidance``, ``negative_prompt``), queues a job on the server's one
queue and answers the video object at once; ``seconds`` become frames at the
model's fps, snapped onto its lattice (the object's ``frames`` and ``snapped``
say so). ``GET /v1/videos/{id}`` is the object with its ``status`` and
``progress``; ``/content`` the MP4 (``variant=thumbnail`` / ``spritesheet``:
PNG); ``DELETE`` forgets it. The shape gate refuses before anything is queued
(422 ``invalid_video_shape``). The engine's own SSE stream follows the job at
``/v1/videos/{id}/events``. So the official ``openai`` client's
``videos.create / retrieve / download_content`` work unchanged.
"""

from __future__ import annotations

import re
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError
from pydantic_core import from_json
from starlette.concurrency import run_in_threadpool

from engine import Engine
from engine.errors import EngineError
from engine.requests import GenerateBody
from engine.requests.bodies import MAX_FPS, MAX_FRAMES, MAX_SEED, MAX_STEPS, Body, Guidance, Prompt
from engine.server.confined import Confined
from engine.server.events import event_stream, job_events
from engine.server.jobs import Job, JobQueue

#: OpenAI's statuses for the queue's states.
STATUS = {"queued": "queued", "running": "in_progress", "done": "completed", "failed": "failed",
          "cancelled": "failed"}
#: ``WxH``, each side a whole number of pixels from 10 (no leading zero: ``00x00`` names no size).
_SIZE = re.compile(r"^([1-9]\d{1,4})x([1-9]\d{1,4})$")


class OpenAIVideoBody(Body):
    """OpenAI's create fields and the engine's own, held to the request models' limits."""

    prompt: Prompt
    model: Annotated[str, Field(max_length=200)] | None = None
    seconds: Annotated[float, Field(gt=0, le=120, allow_inf_nan=False)] | None = None
    size: Annotated[str, Field(pattern=_SIZE.pattern)] | None = None
    frames: Annotated[int, Field(ge=1, le=MAX_FRAMES)] | None = None
    fps: Annotated[int, Field(ge=1, le=MAX_FPS)] | None = None
    #: Frames each window of a long clip renders (``GenerateBody.window_frames``).
    window_frames: Annotated[int, Field(ge=1, le=MAX_FRAMES)] | None = None
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    guidance: Guidance | None = None
    #: A two-expert model's low-noise guidance (``GenerateBody.guidance_2``).
    guidance_2: Guidance | None = None
    negative_prompt: Prompt | None = None

    def dimensions(self) -> tuple[int | None, int | None]:
        match = _SIZE.match(self.size or "")
        return (int(match[1]), int(match[2])) if match else (None, None)


_NUMBERS = {"seconds": float, "frames": int, "fps": int, "window_frames": int, "steps": int, "seed": int,
            "guidance": float, "guidance_2": float}


async def read_video_form(request: Request) -> tuple[OpenAIVideoBody, bytes | None]:
    """The create request (multipart as OpenAI's client sends it, or JSON), or a 422 naming the field."""
    upload: bytes | None = None
    if request.headers.get("content-type", "").startswith("application/json"):
        try:  # pydantic-core's reader: malformed or 100,000-deep JSON is a ValueError, never a RecursionError
            data = from_json(await request.body())
        except ValueError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "input": None,
                                           "msg": f"the body is not JSON an object can be read from ({exc})"}]) from None
    else:
        try:
            form = await request.form(max_files=1, max_fields=20)
        except (AssertionError, ValueError) as exc:
            raise EngineError(f"the video request must be multipart/form-data or JSON ({exc})",
                              code="invalid_request") from exc
        data = {}
        for key, value in form.items():
            if not isinstance(value, str):
                if key == "input_reference":
                    upload = await value.read()
                continue
            try:
                data[key] = _NUMBERS[key](value) if key in _NUMBERS else value
            except ValueError:
                data[key] = value  # refused by the model below, naming the field
    if not isinstance(data, dict):
        raise EngineError("the video request body must be an object", code="invalid_request")
    try:
        return OpenAIVideoBody.model_validate(data), upload
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


#: What ``GET /v1/videos/{id}/content?variant=`` serves, and each one's media type.
VARIANTS = ("video", "thumbnail", "spritesheet", "wav")
MEDIA_TYPES = {"mp4": "video/mp4", "wav": "audio/wav"}


def video_object(job: Job) -> dict[str, Any]:
    """OpenAI's video object for a job, with the engine's shape fields beside it."""
    files = job.video or {}
    shape = files.get("shape") or files.get("planned") or {}
    steps = job.steps or 1
    progress = 100 if job.state == "done" else int(100 * job.step / steps) if job.state == "running" else 0
    return {
        "id": job.id, "object": "video", "model": files.get("model", ""), "status": STATUS[job.state],
        "progress": progress, "created_at": int(job.created),
        "completed_at": int(job.finished) if job.finished and job.state == "done" else None,
        "expires_at": None, "prompt": job.body.prompt,
        "seconds": f"{shape.get('seconds', 0):g}", "size": f"{shape.get('width')}x{shape.get('height')}",
        "remixed_from_video_id": None,
        "error": None if job.error is None else {"code": job.error.code, "message": job.error.message},
        "frames": shape.get("frames"), "fps": shape.get("fps"), "snapped": files.get("note") or None,
        "step": job.step, "steps": job.steps, "audio": files.get("audio"),
    }


def videos_router(engine: Engine, confined: Confined, queue: JobQueue) -> APIRouter:
    api = APIRouter(prefix="/v1/videos")

    @api.post("")
    async def create(request: Request) -> dict[str, Any]:
        form, upload = await read_video_form(request)
        ticket = await run_in_threadpool(_video_request, engine, confined, form, upload)
        job = queue.submit(ticket, video={"note": ticket.note, "planned": ticket.shape.to_dict(),
                                          "model": ticket.target.name})
        return video_object(job)

    @api.get("")
    def listing() -> dict[str, Any]:
        data = [video_object(job) for job in queue.jobs() if job.kind == "video"]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}

    @api.get("/{video_id}")
    def retrieve(video_id: str) -> dict[str, Any]:
        return video_object(_video_job(queue, video_id))

    @api.get("/{video_id}/content", response_class=Response)
    def content(video_id: str, variant: str = "video") -> Response:
        job = _video_job(queue, video_id)
        if variant not in VARIANTS:
            raise EngineError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}", code="invalid_request")
        files = job.video or {}
        key = "mp4" if variant == "video" else variant
        if key == "wav" and job.state == "done" and files.get("wav") is None:
            raise EngineError(f"video {video_id} has no sound (its model renders silent clips); ask for variant=video", code="no_sound")
        if job.state != "done" or key not in files:
            raise EngineError(f"video {video_id} is {STATUS[job.state]}; its content is there once it is "
                              "completed (and until it is deleted or pushed out of the kept jobs)",
                              code="not_ready")
        return Response(files[key], media_type=MEDIA_TYPES.get(key, "image/png"))

    @api.delete("/{video_id}")
    def delete(video_id: str) -> dict[str, Any]:
        job = queue.delete(_video_job(queue, video_id).id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    @api.get("/{video_id}/events", response_class=Response)
    def events(video_id: str) -> Response:
        """SSE: ``queued`` (position), ``running``, ``step``, then ``done`` / ``failed`` / ``cancelled``."""
        return event_stream(job_events(_video_job(queue, video_id)))

    return api


def _video_job(queue: JobQueue, video_id: str) -> Job:
    job = queue.get(video_id)
    if job.kind != "video":
        raise EngineError(f"{video_id} is an image job, not a video (GET /v1/images/jobs/{video_id})",
                          code="job_not_found")
    return job


def _video_request(engine: Engine, confined: Confined, form: OpenAIVideoBody, upload: bytes | None) -> Any:
    """The engine's ticket for the form (``engine.videos.check_generate``), judged against the
    model it runs on (the one its ``model`` names, else the loaded one) before it is queued or
    anything is evicted: the model, the clip's shape (``seconds`` snapped onto frames: the
    ticket's note), the uploaded image's header."""
    from pydantic import ValidationError

    from engine.requests.bodies import describe_problems

    width, height = form.dimensions()
    fields: dict[str, Any] = dict(
        prompt=form.prompt, model=confined.request_model(form.model), negative_prompt=form.negative_prompt,
        steps=form.steps, guidance=form.guidance, guidance_2=form.guidance_2, frames=form.frames, fps=form.fps,
        window_frames=form.window_frames, seed=secrets.randbelow(2**31) if form.seed is None else form.seed)
    uploads = {"image": upload} if upload is not None else None
    seconds = None if form.frames else form.seconds
    try:
        body = GenerateBody(**fields, width=width, height=height)
    except ValidationError as exc:
        if width is not None and any(p["loc"][:1] in (("width",), ("height",)) for p in exc.errors()):
            # A size off the request's lattice: the model's shape gate names its presets (422).
            unsized = engine.videos.check_generate(GenerateBody(**fields), uploads=uploads, seconds=seconds)
            assert unsized.shape is not None  # the videos door decides a clip's shape or refuses
            engine.videos.check_shape(frames=unsized.shape.frames, width=width, height=height, fps=form.fps,
                                      on=unsized.target)
        raise EngineError("; ".join(describe_problems(exc)), code="invalid_request") from None
    return engine.videos.check_generate(body, uploads=uploads, seconds=seconds)
