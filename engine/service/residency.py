"""One owner of the GPU at a time, among the engine's jobs and the host's models.

An app that embeds the engine registers what it keeps on the GPU (a chat
model, another pipeline) as a :class:`Resident` with an evict callback. The
engine's own jobs (the image pipeline, a training run) are owners too.
``acquire(owner)`` evicts every other resident under one lock; the service
calls it only after the last cheap check of a request passed, so a request
that cannot succeed never evicts anything.

One process has one GPU, so it has one arbiter, however many :class:`Residency`
objects it holds (an app may build two ``Engine`` objects): the arbiter that
took the device last is remembered process-wide, and another one's
``acquire`` first asks it to give the device up. It gives it up by evicting
its residents (a loaded pipeline, the host's models) unless a job of its
engine is using the GPU right now (a training run, a generate, a load): then
the second acquire is refused with :class:`~engine.errors.Busy`, before it
evicts anything of its own.

An evict callback that raises is the host's bug, but it must not wedge the
engine: the resident is dropped (its memory is the host's to free now), the
job that asked is refused with ``evict_failed`` naming it, and the next job
runs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import Busy, EngineError

#: Taken before any arbiter's own lock, so two arbiters never wait on each other.
_DEVICE_LOCK = threading.RLock()
#: The arbiter that took the device last (weak: a dropped engine holds nothing).
_holder: weakref.ReferenceType[Residency] | None = None


@dataclass
class Resident:
    """Something holding GPU memory that the engine may ask to leave."""

    name: str
    #: Frees its memory; what it returns is not read (the engine's own drop says whether it held one).
    evict: Callable[[], object]
    size_gb: float = 0.0
    evictions: int = field(default=0, compare=False)


class EvictFailed(EngineError):
    """A resident's evict callback raised; it was dropped, the job refused."""

    code = "evict_failed"


class Residency:
    """The GPU arbiter. Thread-safe; every method takes the one lock."""

    def __init__(self, *, busy: Callable[[], str | None] | None = None) -> None:
        """``busy``: what job of this arbiter's engine uses the GPU now (None: none),
        asked when another arbiter in the process wants the device."""
        self._lock = threading.RLock()
        self._residents: dict[str, Resident] = {}
        self._owner: str | None = None
        self._busy = busy

    @property
    def owner(self) -> str | None:
        return self._owner

    def register(self, resident: Resident) -> None:
        with self._lock:
            self._residents[resident.name] = resident

    def unregister(self, name: str) -> bool:
        """Forget ``name``; True when it was registered."""
        with self._lock:
            known = self._residents.pop(name, None) is not None
            if self._owner == name:
                self._owner = None
            return known

    def residents(self) -> list[Resident]:
        with self._lock:
            return list(self._residents.values())

    def acquire(self, owner: str) -> list[str]:
        """Make ``owner`` the GPU's owner, evicting every other resident.

        :return: the names evicted, in order.
        :raises EvictFailed: a callback raised; that resident is dropped, the
            ones after it are left alone, and the owner is unchanged.
        """
        global _holder
        with _DEVICE_LOCK, self._lock:
            other = _holder() if _holder is not None else None
            if other is not None and other is not self:
                other._give_up_device(owner)
            evicted = self._evict_all(keep=owner)
            self._owner = owner
            _holder = weakref.ref(self)
            return evicted

    def _evict_all(self, keep: str | None = None) -> list[str]:
        with self._lock:
            evicted = []
            for resident in list(self._residents.values()):
                if resident.name == keep:
                    continue
                try:
                    resident.evict()
                except Exception as exc:  # noqa: BLE001 - a host callback may raise anything
                    self._residents.pop(resident.name, None)
                    raise EvictFailed(
                        f"evicting {resident.name!r} failed ({type(exc).__name__}: {exc}); it was "
                        "unregistered, so its memory may still be held. Free it, then start again."
                    ) from exc
                resident.evictions += 1
                evicted.append(resident.name)
                # An evicted engine job stops being a resident; a host model
                # stays registered so it can be evicted again after reloading.
            return evicted

    def _give_up_device(self, wanted_by: str) -> None:
        """Another arbiter of this process wants the GPU: evict everything here, or
        refuse with Busy while a job of this one's engine is using it."""
        with self._lock:
            job = self._busy() if self._busy is not None else (
                self._owner if self._owner is not None and self._owner not in self._residents else None)
            if job is not None:
                raise Busy(
                    f"the GPU is in use by another Engine in this process (it is {job}); one process has "
                    f"one GPU arbiter, so {wanted_by} waits: try again when that job is done, or use one Engine"
                )
            self._evict_all()
            self._owner = None

    def release_if(self, predicate: Callable[[str | None], bool]) -> bool:
        """Give the GPU up if ``predicate(owner)`` holds, atomically.

        A finished training run releases with ``lambda o: o == its_name``,
        so it can never release a GPU a newer job already took.
        """
        with self._lock:
            if predicate(self._owner):
                self._owner = None
                return True
            return False
