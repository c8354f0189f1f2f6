"""An idle loaded pipeline goes: ``serve --keep-alive SECONDS``, as Ollama's ``keep_alive``.

Every load and every generate (images and videos) restarts the clock. When
it runs out with nothing running, the pipeline is unloaded and its memory
given back; a generate or a load then in progress is never pulled from under
(the expiry is put off until the engine is idle). ``None`` keeps the model
until told (the default, as before), ``0`` unloads it after each call.
The status says what is loaded, since when and until when.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

#: How long an expiry that found the engine busy waits before it looks again.
RETRY_S = 0.5


class KeepAlive:
    """The idle clock of one engine's loaded pipeline."""

    def __init__(self, unload: Callable[[], bool], busy: Callable[[], bool], seconds: float | None = None) -> None:
        self._unload, self._busy = unload, busy
        #: Seconds a loaded pipeline stays idle before it is unloaded (None: until told).
        self.seconds = seconds
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._since: float | None = None
        self._until: float | None = None
        self._turn = 0

    def loaded(self) -> None:
        """A pipeline was loaded: its clock starts."""
        self._since = time.time()
        self.touch()

    def touch(self, seconds: float | None = None) -> None:
        """The pipeline was used: its idle time starts again, ``seconds`` long where the call
        said (a request's ``keep_alive``), else :attr:`seconds`."""
        with self._lock:
            self._cancel()
            keep = self.seconds if seconds is None else seconds
            if self._since is None or keep is None:
                return
            self._arm(keep)

    def stop(self) -> None:
        """The pipeline is gone (unloaded, evicted): no clock."""
        with self._lock:
            self._cancel()
            self._since = None

    def status(self) -> dict[str, object]:
        return {"seconds": self.seconds, "loaded_since": _iso(self._since), "until": _iso(self._until)}

    def _arm(self, delay: float) -> None:
        self._turn += 1
        self._until = time.time() + delay
        self._timer = threading.Timer(max(0.0, delay), self._expire, args=(self._turn,))
        self._timer.daemon = True
        self._timer.name = "engine-keep-alive"
        self._timer.start()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._until = None, None
        self._turn += 1

    def _expire(self, turn: int) -> None:
        with self._lock:
            if turn != self._turn:
                return  # touched since: a newer clock runs
            if self._busy():
                self._arm(RETRY_S)
                return
            self._timer, self._until = None, None
        try:
            self._unload()
        except Exception:  # noqa: BLE001 - a load began meanwhile: it restarts the clock itself
            return


def _iso(stamp: float | None) -> str | None:
    return None if stamp is None else datetime.fromtimestamp(stamp, timezone.utc).isoformat(timespec="seconds")


__all__ = ["KeepAlive"]
