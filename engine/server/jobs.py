"""The generate queue: one FIFO of jobs for the loaded pipeline, run one at a time.

Every generate route goes through it (``POST /v1/images/jobs`` returns at
once; ``/v1/images/generate``, ``/v1/images/generations`` and
``/v1/images/edits`` wait on their job), so concurrent clients queue instead
of refusing each other. A job runs on its own model: the one its request
named (``model``, judged against that model when it was queued, before
anything is evicted: its ticket, ``engine.images.check_generate``), else the one
loaded when it was queued. At its turn the worker loads that model if another is
in (the ticket's generate does), so a job is never failed or drawn with another
model because another job's model came in, or an idle unload took its own.

Jobs are grouped where that saves a load: when the oldest job needs another
model and a later one runs on the loaded model, the later one runs first;
a job is overtaken so at most :data:`MAX_OVERTAKEN` times, so none waits
for ever behind a stream of another model's jobs.

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
     "model": "my-model",      # the model it runs on (its folder's or checkpoint's name)
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

import base64
import collections
import io
import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import Cancelled, EngineError
from engine.requests import GenerateBody
from engine.server.job import TERMINAL, Job, State

__all__ = ["Job", "JobNotFound", "JobQueue", "QueueFull", "TERMINAL"]

log = logging.getLogger("engine.server")

#: Finished jobs kept for ``GET`` (the oldest are forgotten first).
KEPT_JOBS = 256
#: PNG bytes (base64) kept across finished jobs' results; older results are dropped first.
KEPT_RESULT_BYTES = 512 * 1024 * 1024
#: Seconds the worker thread waits for a job before it ends (the next submit starts another).
IDLE_WORKER_S = 30.0
#: Run times the ``Retry-After`` estimate averages.
TIMED_JOBS = 16
#: Times a waiting job may be overtaken by later jobs for the loaded model (grouping).
MAX_OVERTAKEN = 4


class QueueFull(EngineError):
    """The queue holds as many waiting jobs as it may; retry after ``retry_after`` seconds."""

    code = "queue_full"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class JobNotFound(EngineError):
    """No job by that id: never queued here, or forgotten (only the newest finished are kept)."""

    code = "job_not_found"


class JobQueue:
    """FIFO generate jobs for one engine, run by one worker thread (started on first use)."""

    def __init__(self, engine: Any, *, size: int, kept: int = KEPT_JOBS, kept_bytes: int = KEPT_RESULT_BYTES,
                 owner: str = "", gallery: Any = None) -> None:
        """``size``: the bound, at least 1 (:class:`~engine.server.settings.ServerSettings` checks it);
        ``owner``: a serving replica's name, ending every job id (``j-1-ab12.OWNER``) so a
        follow-up reaches the replica that runs the job (:mod:`engine.server.replicas`);
        ``gallery``: where every finished output is kept with its recipe (``engine.open_gallery``)."""
        self._engine = engine
        self.gallery = gallery
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
        self._closed = False  # by close(): no worker starts again
        #: The most jobs ever waiting at once (the bench reads it).
        self.max_depth = 0
        self._ids = itertools.count(1)

    # -- clients ----------------------------------------------------------------------

    def submit(self, request: Any, inputs: Mapping[str, bytes | list[bytes]] | None = None,
               *, video: Mapping[str, Any] | None = None) -> Job:
        """Queue a generate: its ticket (``engine.images.check_generate`` or ``engine.videos``'), or
        a body checked here through the images door (blocking: the check reads headers; call it off
        the event loop); :class:`QueueFull` when ``size`` jobs already wait, ``not_loaded`` when
        it names no model and none is loaded, a named model's refusal before anything is evicted.
        ``inputs``: images uploaded inline, in place of the body's path fields of those names."""
        ticket = self._engine.images.check_generate(request, uploads=inputs) if isinstance(request, GenerateBody) \
            else request
        kind = "video" if ticket.output == "frames" else "images"
        body = ticket.body
        job = Job(f"j-{next(self._ids)}-{secrets.token_hex(6)}{self._suffix}", body, ticket, ticket.target,
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
        stops it before the next block of its current step); a finished job is returned as it is."""
        job = self.get(job_id)
        with self._lock:
            if job.state == "queued":
                self._waiting.remove(job)
                job.cancel.set()
                self._finish(job, "cancelled", Cancelled("the job was cancelled while queued; it never ran"))
                self._renumber()
                return job
        job.cancel.set()  # a running job: the engine raises Cancelled before its next block
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

    def close(self, timeout: float = 60.0) -> None:
        """Cancel every job (the waiting ones never run; the running one stops before its next
        block) and wait up to ``timeout`` seconds for the worker to end: a server shutting down
        (Ctrl-C on ``serve``) then leaves no thread computing inside torch, which would abort
        the interpreter as it exits."""
        with self._lock:
            self._closed = True
            for job in list(self._waiting):
                job.cancel.set()
                self._finish(job, "cancelled", Cancelled("the server shut down before the job ran"))
            self._waiting.clear()
            running, worker = self._running, self._worker
            self._lock.notify_all()
        if running is not None:
            running.cancel.set()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)

    # -- the worker -------------------------------------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None and not self._closed:
            self._worker = threading.Thread(target=self._work, name="engine-generate-queue", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._waiting and not self._closed:
                    self._lock.wait(IDLE_WORKER_S)
                if not self._waiting or self._closed:  # idle: end, so a dropped app's engine can be freed; the next submit starts one
                    self._worker = None
                    return
                job = self._next()
                job.state, job.started, job.position = "running", time.time(), None
                self._running = self._latest = job
                self._renumber()
            job.signal.fire()
            self._run(job)

    def _next(self) -> Job:
        """The next job (under the lock): the oldest, unless it needs another model while a
        later one runs on the loaded model and no job it would pass was passed
        :data:`MAX_OVERTAKEN` times; then that later one."""
        loaded = self._engine.loaded.target()
        if loaded is not None and self._waiting[0].target.key != loaded.key:
            for index, job in enumerate(self._waiting):
                if job.target.key == loaded.key:
                    ahead = list(itertools.islice(self._waiting, index))
                    if all(passed.overtaken < MAX_OVERTAKEN for passed in ahead):
                        for passed in ahead:
                            passed.overtaken += 1
                        del self._waiting[index]
                        return job
                    break
        return self._waiting.popleft()

    def _run(self, job: Job) -> None:
        try:
            body = job.body  # its ticket runs on its model, loaded at its turn if another is in
            if job.kind == "video":
                clip = self._engine.videos.generate(job.ticket, progress=lambda d, t: self._step(job, d, t),
                                                    cancel=job.cancel)
                job.video = {**(job.video or {}), **clip.files()}
                encoded: list[str] = []
                job.gallery = self._keep(job, clip=clip)
            else:
                images = self._engine.images.generate(job.ticket, progress=lambda d, t: self._step(job, d, t),
                                                      cancel=job.cancel)
                pngs = [_png(image) for image in images]
                encoded = [base64.b64encode(png).decode("ascii") for png in pngs]
                job.gallery = self._keep(job, images=list(zip(images, pngs)), body=body)
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

    def _keep(self, job: Job, *, images: Sequence[tuple[Any, bytes]] = (), body: GenerateBody | None = None,
              clip: Any = None) -> list[str]:
        """Keep the job's outputs in the gallery with their recipes; their entry ids. A gallery
        that cannot write (a full disk) is logged and the job still answers its outputs inline."""
        if self.gallery is None:
            return []
        try:
            if clip is not None:
                files = job.video or {}
                entry = self.gallery.add("video", files["mp4"], thumbnail=files["thumbnail"], recipe=clip.recipe,
                                         width=clip.shape.width, height=clip.shape.height, job=job.id)
                return [entry.id]
            recipes = self._engine.loaded.recipes(body, [image for image, _ in images])
            return [self.gallery.add("image", png, recipe=recipe, width=image.width, height=image.height,
                                     job=job.id).id for (image, png), recipe in zip(images, recipes)]
        except OSError as error:
            log.warning("job %s: its outputs could not be kept in the gallery (%s)", job.id, error)
            return []

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
        job.ticket = None
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



def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()

