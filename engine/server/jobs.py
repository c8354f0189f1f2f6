"""The generate queue: one FIFO of jobs for the loaded pipeline, run one at a time.

Every generate route goes through it (``POST /v1/images/jobs`` returns at
once; ``/v1/images/generate``, ``/v1/images/generations`` and
``/v1/images/edits`` wait on their job), so concurrent clients queue instead
of refusing each other. The engine holds one pipeline at a time, so one queue
is the loaded model's queue; a job remembers the load it was queued for and
fails with ``model_changed`` (409) if that model was unloaded or replaced by
another before its turn, rather than drawing with another model.

The queue is bounded (``ServerSettings.queue_size``: jobs waiting, the
running one not counted); a submit beyond it is :class:`QueueFull` (HTTP 429
with ``Retry-After``, an estimate from recent job times). Finished jobs are
kept for ``GET`` (the newest :data:`KEPT_JOBS`, their PNGs within
:data:`KEPT_RESULT_BYTES`; the oldest go first).

A job, as ``GET /v1/images/jobs/{id}`` (and every SSE event) shows it::

    {"id": "j-3f0c...", "state": "queued" | "running" | "done" | "failed" | "cancelled",
     "position": 1,            # place in the queue, 1 = runs next; null unless queued
     "step": 0, "steps": 30,   # denoising progress (steps: 0 until the job starts, if not given)
     "created": 1767000000.1, "started": null, "finished": null,   # unix seconds
     "seconds": null,          # run time once finished
     "request": {"prompt": "...", "width": 1024, "height": 1024, "count": 1},
     "images": ["<base64 PNG>", ...],   # done only; [] once the result was dropped
     "error": null | {"code": "...", "message": "..."}}

Batching: consecutive same-size jobs are not merged into one pipeline
call. Measured with ``bench/serve_load.py --batch-probe`` (tiny pipeline,
CPU): a merged call runs one image per forward there, as the engine does on
the CPU so an image replays alone from its seed, and is no faster than
separate calls; forcing one forward per merged batch was 2.3x faster but
breaks that replay guarantee.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import Cancelled, EngineError
from engine.requests import GenerateBody

log = logging.getLogger("engine.server")

State = Literal["queued", "running", "done", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})

#: Finished jobs kept for ``GET`` (the oldest are forgotten first).
KEPT_JOBS = 256
#: PNG bytes (base64) kept across finished jobs' results; older results are dropped first.
KEPT_RESULT_BYTES = 512 * 1024 * 1024
#: Seconds the worker thread waits for a job before it ends (the next submit starts another).
IDLE_WORKER_S = 30.0
#: Run times the ``Retry-After`` estimate averages.
TIMED_JOBS = 16


class Signal:
    """Wakes asyncio waiters, on whatever loop they wait, when something changed;
    fired from any thread (the queue's worker). ``version`` counts the changes,
    so a waiter that read the state at version v misses nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.version = 0

    def fire(self) -> None:
        with self._lock:
            self.version += 1
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_wake, future)

    async def wait(self, seen: int, timeout: float) -> None:
        """Return once ``version`` differs from ``seen``, or after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.version != seen:
                return
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            pass
        finally:  # timed out, or the waiting task was cancelled (its client went away)
            with self._lock:
                if (loop, future) in self._waiters:
                    self._waiters.remove((loop, future))


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class QueueFull(EngineError):
    """The queue holds as many waiting jobs as it may; retry after ``retry_after`` seconds."""

    code = "queue_full"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class JobNotFound(EngineError):
    """No job by that id: never queued here, or forgotten (only the newest finished are kept)."""

    code = "job_not_found"


class ModelChanged(EngineError):
    """The model a job was queued for was unloaded or replaced before its turn (HTTP 409)."""

    code = "model_changed"


@dataclass(eq=False)
class Job:
    """One generate request and what became of it. Mutated only under the queue's lock."""

    id: str
    #: The request, as every face passes it to ``engine.images.generate`` (its paths confined).
    body: GenerateBody
    #: Images uploaded inline (OpenAI's edits), by the generate option they fill; dropped once the job ends.
    inputs: dict[str, bytes]
    #: The model this job is for (the loaded pipeline's source when it was queued).
    model: Any
    state: State = "queued"
    step: int = 0
    steps: int = 0
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    images: list[str] = field(default_factory=list)
    error: EngineError | None = None
    #: Set to stop the job: before it starts, or at the engine's next step.
    cancel: threading.Event = field(default_factory=threading.Event)
    #: Fired on every change (state, position, step).
    signal: Signal = field(default_factory=Signal)
    position: int | None = None
    #: ``images`` or ``video`` (a clip through ``engine.videos``; the OpenAI videos API's jobs).
    kind: str = "images"
    #: A finished clip: its MP4, thumbnail PNG and spritesheet PNG bytes, its shape and snap note.
    video: dict[str, Any] | None = None

    @property
    def prompt(self) -> str:
        return self.body.prompt

    @property
    def finished_state(self) -> bool:
        return self.state in TERMINAL

    def to_dict(self, *, images: bool = True) -> dict[str, Any]:
        """The job's JSON (see the module docstring); ``images=False`` leaves the PNGs out."""
        body = self.body
        return {
            "id": self.id,
            "state": self.state,
            "position": self.position,
            "step": self.step,
            "steps": self.steps,
            "created": round(self.created, 3),
            "started": None if self.started is None else round(self.started, 3),
            "finished": None if self.finished is None else round(self.finished, 3),
            "seconds": None if self.started is None or self.finished is None else round(self.finished - self.started, 3),
            "request": {"prompt": body.prompt, "width": body.width, "height": body.height, "count": body.count},
            "images": list(self.images) if images else len(self.images),
            "error": None if self.error is None else {"code": self.error.code, "message": self.error.message},
        }


class JobQueue:
    """FIFO generate jobs for one engine, run by one worker thread (started on first use)."""

    def __init__(self, engine: Any, *, size: int, kept: int = KEPT_JOBS, kept_bytes: int = KEPT_RESULT_BYTES,
                 owner: str = "") -> None:
        """``size``: the bound, at least 1 (:class:`~engine.server.settings.ServerSettings` checks it);
        ``owner``: a serving replica's name, ending every job id (``j-1-ab12.OWNER``) so a
        follow-up reaches the replica that runs the job (:mod:`engine.server.replicas`)."""
        self._engine = engine
        self._suffix = f".{owner}" if owner else ""
        self.size = size
        self._kept, self._kept_bytes = kept, kept_bytes
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._jobs: dict[str, Job] = {}
        self._finished: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._latest: Job | None = None
        self._times: collections.deque[float] = collections.deque(maxlen=TIMED_JOBS)
        self._worker: threading.Thread | None = None
        #: The most jobs ever waiting at once (the bench reads it).
        self.max_depth = 0
        self._ids = itertools.count(1)

    # -- clients ----------------------------------------------------------------------

    def submit(self, body: GenerateBody, inputs: Mapping[str, bytes] | None = None, *,
               kind: str = "images", video: Mapping[str, Any] | None = None) -> Job:
        """Queue a generate; :class:`QueueFull` when ``size`` jobs already wait,
        ``not_loaded`` when there is no pipeline to queue for. ``inputs``: images
        uploaded inline, in place of the body's path fields of those names."""
        model = self._loaded_model()
        if model is None:
            raise EngineError("no image pipeline is loaded; load one first (POST /v1/images/load)", code="not_loaded")
        job = Job(f"j-{next(self._ids)}-{secrets.token_hex(6)}{self._suffix}", body, dict(inputs or {}), model,
                  steps=body.steps or 0, kind=kind, video=dict(video or {}) if kind == "video" else None)
        with self._lock:
            if len(self._waiting) >= self.size:
                retry = self._retry_after()
                raise QueueFull(f"the generate queue is full ({self.size} jobs waiting); retry in about {retry} s "
                                "(the server's --queue-size sets the bound)", retry_after=retry)
            self._waiting.append(job)
            job.position = len(self._waiting)
            self._jobs[job.id] = job
            self.max_depth = max(self.max_depth, len(self._waiting))
            self._start_worker()
            self._lock.notify_all()
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id[:80]!r} (unknown, or finished long enough ago to be forgotten: "
                              f"the newest {self._kept} finished jobs are kept)")
        return job

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued job (it never runs) or a running one (the engine
        stops it after its current step); a finished job is returned as it is."""
        job = self.get(job_id)
        with self._lock:
            if job.state == "queued":
                self._waiting.remove(job)
                job.cancel.set()
                self._finish(job, "cancelled", Cancelled("the job was cancelled while queued; it never ran"))
                self._renumber()
                return job
        job.cancel.set()  # a running job: the engine raises Cancelled at its next step
        return job

    def status(self) -> dict[str, Any]:
        """The queue at a glance, for ``GET /v1/images/status``."""
        with self._lock:
            return {"waiting": len(self._waiting), "size": self.size, "max_waiting": self.max_depth,
                    "running": self._running.id if self._running else None}

    def jobs(self) -> list[Job]:
        """Every job held: the waiting ones, the running one, the kept finished ones; newest first."""
        with self._lock:
            held = [*self._finished, *([self._running] if self._running else []), *self._waiting]
        return sorted(held, key=lambda job: job.created, reverse=True)

    def progress(self) -> dict[str, Any]:
        """The running (else the latest) job's progress: ``{state, step, steps}``, ``idle`` before any."""
        with self._lock:
            job = self._running or self._latest
            if job is None:
                return {"state": "idle", "step": 0, "steps": 0}
            return {"state": job.state, "step": job.step, "steps": job.steps, "id": job.id}

    def delete(self, job_id: str) -> Job:
        """Forget a job and its files (a running one is cancelled first, then forgotten as it ends)."""
        job = self.cancel(job_id)
        with self._lock:
            self._jobs.pop(job.id, None)
            if job in self._finished:
                self._finished.remove(job)
            job.images, job.video = [], None
        return job

    def drop_result(self, job: Job) -> None:
        """Forget a delivered result (a waiting route already sent the images)."""
        with self._lock:
            job.images = []

    # -- the worker -------------------------------------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="engine-generate-queue", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    self._lock.wait(IDLE_WORKER_S)
                if not self._waiting:  # idle: end, so a dropped app's engine can be freed; the next submit starts one
                    self._worker = None
                    return
                job = self._waiting.popleft()
                job.state, job.started, job.position = "running", time.time(), None
                self._running = self._latest = job
                self._renumber()
            job.signal.fire()
            self._run(job)

    def _run(self, job: Job) -> None:
        try:
            if self._loaded_model() != job.model:
                raise ModelChanged("the pipeline this job was queued for was unloaded or replaced before its turn; "
                                   "load the model again and resubmit")
            if job.kind == "video":
                clip = self._engine.videos.generate(job.body, progress=lambda d, t: self._step(job, d, t),
                                                    cancel=job.cancel, **job.inputs)
                job.video = {**(job.video or {}), **clip.files()}
                encoded: list[str] = []
            else:
                images = self._engine.images.generate(job.body, progress=lambda d, t: self._step(job, d, t),
                                                      cancel=job.cancel, **job.inputs)
                encoded = [_png_b64(image) for image in images]
        except Cancelled as error:
            self._end(job, "cancelled", error)
        except EngineError as error:
            self._end(job, "failed", error)
        except Exception:  # a bug or a library failure: the job fails, the queue lives on
            log.exception("generate job %s failed", job.id)
            self._end(job, "failed", EngineError("the generate failed; the error is logged on the server",
                                                 code="internal_error"))
        else:
            self._end(job, "done", None, encoded)

    def _loaded_model(self) -> Any:
        """The loaded pipeline's model (its source: path, family, checkpoint), or None."""
        pipeline = self._engine.status().get("pipeline")
        return pipeline.get("model") if isinstance(pipeline, dict) else None

    def _step(self, job: Job, done: int, total: int) -> None:
        with self._lock:
            job.step, job.steps = done, total
        job.signal.fire()

    def _end(self, job: Job, state: State, error: EngineError | None, images: list[str] | None = None) -> None:
        with self._lock:
            self._running = None
            job.images = images or []
            self._finish(job, state, error)
            if state == "done" and job.started is not None and job.finished is not None:
                self._times.append(job.finished - job.started)

    def _finish(self, job: Job, state: State, error: EngineError | None) -> None:
        """Record the end (under the lock), keep it bounded, wake the job's watchers."""
        job.state, job.error, job.finished, job.position = state, error, time.time(), None
        # A kept record holds its request, not its uploads (an image, a mask).
        job.inputs = {}
        self._finished.append(job)
        while len(self._finished) > self._kept:
            self._jobs.pop(self._finished.popleft().id, None)
        held = sum(_size(j) for j in self._finished)
        for old in self._finished:
            if held <= self._kept_bytes:
                break
            held -= _size(old)
            old.images, old.video = [], None
        job.signal.fire()

    def _renumber(self) -> None:
        """Give every waiting job its place again (under the lock) and wake its watchers."""
        for place, waiting in enumerate(self._waiting, start=1):
            if waiting.position != place:
                waiting.position = place
                waiting.signal.fire()

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: a place frees each time a job
        starts, so about one recent run time (1 s before any has finished)."""
        mean = sum(self._times) / len(self._times) if self._times else 1.0
        return max(1, min(3600, math.ceil(mean)))


def _size(job: Job) -> int:
    files = job.video or {}
    return sum(len(image) for image in job.images) + sum(len(v) for v in files.values() if isinstance(v, bytes))



def _png_b64(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")

