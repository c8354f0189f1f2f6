"""A generate job and what wakes its watchers: the records the queue (:mod:`engine.server.jobs`),
its routes and the event streams share; the JSON a job answers with is in the queue's docstring."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import EngineError
from engine.requests import GenerateBody

State = Literal["queued", "running", "done", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})

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


@dataclass(eq=False)
class Job:
    """One generate request and what became of it. Mutated only under the queue's lock."""

    id: str
    #: The request as it runs (its paths confined; a clip's shape decided).
    body: GenerateBody
    #: Its checks, passed (``engine.images.check_generate``): the model, the inputs (uploads
    #: included), the LoRAs; dropped once the job ends.
    ticket: Any
    #: The model the job runs on (the ticket's: the one its request named, else the one loaded
    #: when it was queued); loaded at its turn if another is in by then.
    target: Any
    state: State = "queued"
    step: int = 0
    steps: int = 0
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    images: list[str] = field(default_factory=list)
    #: The gallery entries its outputs were kept as (ids), when the server keeps a gallery.
    gallery: list[str] = field(default_factory=list)
    error: EngineError | None = None
    #: Set to stop the job: before it starts, or at the engine's next step.
    cancel: threading.Event = field(default_factory=threading.Event)
    #: Fired on every change (state, position, step).
    signal: Signal = field(default_factory=Signal)
    position: int | None = None
    #: Times a job queued after it ran first because its model was already loaded (bounded).
    overtaken: int = 0
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
            "model": self.target.name,
            "request": {"prompt": body.prompt, "width": body.width, "height": body.height, "count": body.count},
            "images": list(self.images) if images else len(self.images),
            "gallery": list(self.gallery),
            "error": None if self.error is None else {"code": self.error.code, "message": self.error.message},
        }
