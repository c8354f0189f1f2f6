"""The trainer child's entry point: ``python -m engine.training.child FD PARENT_PID``.

The child is started as this module, never through ``multiprocessing``'s
spawn: spawn re-runs the parent's ``__main__`` in the child (its
``_fixup_main_from_path``), so an app embedding the engine from a plain
script with no ``if __name__ == "__main__"`` guard would start a second
engine in the child, evict its residents again and leave the run pending.
Here the child imports only the engine; the host's script is never read.

Protocol on the one socket (file descriptor ``FD``, a
:class:`multiprocessing.connection.Connection`): the parent sends the
parent's ``sys.path`` (so plugins and the plan unpickle as they would
there), then ``(plan, folder)``, then stop requests ("save", "discard",
"cancel") at any time; the child sends events (dicts) back. With ``gpus``
above 1 the child launches the ranks (:mod:`engine.training.launch`) and
rank 0 uses this socket in its place.

The child runs in its own process group and ignores SIGINT: Ctrl-C at a
terminal reaches the CLI, which asks the child to stop after the current
step and save; the terminal never interrupts the child mid-step.
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

#: Stop requests, weakest first: a later, stronger request overrides an earlier one.
STOP_ORDER: tuple[str, ...] = ("save", "discard", "cancel")


class ControlChannel:
    """Events out, stop requests in; a stop request, once made, is remembered."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._requested: str | None = None

    def emit(self, event: dict[str, object]) -> None:
        self._conn.send(event)

    def should_stop(self) -> str | None:
        """The strongest stop request so far, or None; never blocks."""
        try:
            while self._conn.poll(0):
                message = str(self._conn.recv())
                if message in STOP_ORDER and (
                    self._requested is None or STOP_ORDER.index(message) > STOP_ORDER.index(self._requested)
                ):
                    self._requested = message
        except (EOFError, OSError):
            os._exit(75)  # the parent is gone: nobody is left to report to
        return self._requested


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the CLI owns Ctrl-C; it asks us to stop
    fd, parent_pid = int(argv[0]), int(argv[1])
    from engine.training.lineage import die_with_parent

    die_with_parent(parent_pid)
    conn = Connection(fd)
    try:
        paths = conn.recv()
    except EOFError:
        return 75
    sys.path[:0] = [p for p in paths if p not in sys.path]
    channel = ControlChannel(conn)
    try:
        plan, folder = conn.recv()
    except Exception as exc:  # a plan that cannot be read here is the run's error, reported
        channel.emit({"type": "error", "code": "trainer_start_failed",
                      "message": f"the trainer process could not read its plan ({type(exc).__name__}: {exc}); "
                                 "the engine and the trainer may be different versions: reinstall and start again"})
        return 1
    channel.emit({"type": "phase", "phase": "starting", "message": "the trainer process is up"})
    if getattr(plan.config, "gpus", 1) > 1 or getattr(plan.config, "nodes", 1) > 1:
        from engine.training.launch import launch

        launch(plan, Path(folder), channel)  # the ranks, under accelerate; rank 0 speaks on this socket
    else:
        run(plan, Path(folder), channel)
    conn.close()
    return 0


def run(plan: Any, folder: Path, channel: ControlChannel) -> None:
    """Train and report how it ended; every failure becomes an error event."""
    from engine.logs import quiet_library_logs
    from engine.training.records import error_event

    quiet_library_logs(progress_bars=False)
    from engine.training.trainer import run_training

    try:
        channel.emit(run_training(plan, folder, channel.emit, channel.should_stop))
    except Exception as exc:  # the child reports every failure; the parent decides
        channel.emit(error_event(exc))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
