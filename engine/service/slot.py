"""The one GPU job at a time: the reservation every part of the facade takes.

A load, a generate and a training start each reserve the slot before they
evict anything, and give it back when they end; a second job meanwhile is
:class:`~engine.errors.Busy`. The slot also holds the device's arbiter
(:class:`~engine.service.residency.Residency`), which asks the slot what job
runs when another engine of the process wants the GPU.
"""

from __future__ import annotations

import threading

from engine.errors import Busy
from engine.service.residency import Residency

#: The residency names of the engine's own jobs (a host may not register these).
PIPELINE = "engine.pipeline"
TRAINER = "engine.trainer"


class JobSlot:
    """The reservation (one job name or None) under one lock, and the GPU arbiter."""

    def __init__(self, residency: Residency | None = None) -> None:
        self.lock = threading.Lock()
        self._job: str | None = None
        self.residency = residency or Residency(busy=lambda: self._job)

    @property
    def job(self) -> str | None:
        """The job holding the engine now (``loading``, ``generating``, ``training``), or None."""
        return self._job

    def reserve(self, job: str) -> None:
        """Take the slot for ``job``, or refuse with :class:`Busy` naming the job that holds it."""
        with self.lock:
            if self._job is not None:
                raise Busy(f"the engine is busy {self._job}; try again when it is done")
            self._job = job

    def release(self, job: str) -> None:
        """Give the slot back, if ``job`` still holds it."""
        with self.lock:
            if self._job == job:
                self._job = None

    def refuse_if(self, job: str, message: str) -> None:
        """:class:`Busy` with ``message`` while ``job`` holds the slot (checked under the lock)."""
        with self.lock:
            if self._job == job:
                raise Busy(message)
