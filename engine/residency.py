"""One owner of the GPU at a time, among the engine's jobs and the host's models.

An app that embeds the engine registers what it keeps on the GPU (a chat
model, another pipeline) as a :class:`Resident` with an evict callback. The
engine's own jobs (the image pipeline, a training run) are owners too.
``acquire(owner)`` evicts every other resident under one lock; the service
calls it only after the last cheap check of a request passed, so a request
that cannot succeed never evicts anything.

An evict callback that raises is the host's bug, but it must not wedge the
engine: the resident is dropped (its memory is the host's to free now), the
job that asked is refused with ``evict_failed`` naming it, and the next job
runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import EngineError


@dataclass
class Resident:
    """Something holding GPU memory that the engine may ask to leave."""

    name: str
    evict: Callable[[], None]
    size_gb: float = 0.0
    evictions: int = field(default=0, compare=False)


class EvictFailed(EngineError):
    """A resident's evict callback raised; it was dropped, the job refused."""

    code = "evict_failed"


class Residency:
    """The GPU arbiter. Thread-safe; every method takes the one lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._residents: dict[str, Resident] = {}
        self._owner: str | None = None

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
        with self._lock:
            evicted = []
            for resident in list(self._residents.values()):
                if resident.name == owner:
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
            self._owner = owner
            return evicted

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
