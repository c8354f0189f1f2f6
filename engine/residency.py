"""One owner of the GPU at a time, among the engine's jobs and the host's models.

An app that embeds the engine registers what it keeps on the GPU (a chat
model, another pipeline) as a :class:`Resident` with an evict callback. The
engine's own jobs (the image pipeline, a training run) are owners too.
``acquire(owner)`` evicts every other resident under one lock; the service
calls it only after the last cheap check of a request passed, so a request
that cannot succeed never evicts anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Resident:
    """Something holding GPU memory that the engine may ask to leave."""

    name: str
    evict: Callable[[], None]
    size_gb: float = 0.0
    evictions: int = field(default=0, compare=False)


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

    def unregister(self, name: str) -> None:
        with self._lock:
            self._residents.pop(name, None)
            if self._owner == name:
                self._owner = None

    def residents(self) -> list[Resident]:
        with self._lock:
            return list(self._residents.values())

    def acquire(self, owner: str) -> list[str]:
        """Make ``owner`` the GPU's owner, evicting every other resident.

        :return: the names evicted, in order.
        """
        with self._lock:
            evicted = []
            for resident in list(self._residents.values()):
                if resident.name == owner:
                    continue
                resident.evict()
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
