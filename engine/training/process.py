"""The trainer's process: how it starts (forked from the warm server, or a fresh
interpreter) and the socket it talks on; how it dies with its parent is
:mod:`engine.training.lineage`.

The rules are those of :mod:`engine.training.runner` (which watches the
run): the child has its own session and ignores the terminal's SIGINT; it
asks the kernel for SIGKILL when its parent goes (``PR_SET_PDEATHSIG``,
Linux) and watches the parent PID everywhere; the kernel ties that signal
to the thread that spawned the child, so a keeper thread that lives as
long as the child starts it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.training.lineage import child_env, start_kept

if TYPE_CHECKING:
    from engine.training.forkserver import Forked
    from engine.training.preflight import TrainingPlan


class Child:
    """The trainer process, its socket and the keeper thread that reaps it.

    Linux sends the parent-death signal when the *thread* that started the
    child ends, so the child is started from a keeper thread that lives
    exactly as long as it (a server's request thread may end long before
    the run); the keeper waits for the exit, so ``exitcode`` is the real one.
    """

    def __init__(self, process: subprocess.Popen[bytes] | Forked, conn: Connection) -> None:
        """``process``: a started interpreter, or a trainer forked by the fork server."""
        self._popen = process
        self._conn = conn
        self._send_lock = threading.Lock()
        self._exited = threading.Event()
        self._eof = False

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.returncode if self._exited.is_set() else None

    def is_alive(self) -> bool:
        return not self._exited.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._exited.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            self._popen.kill()

    def send(self, message: object) -> None:
        """Send to the child; a child that is gone has nothing left to stop."""
        with self._send_lock, contextlib.suppress(OSError, EOFError, ValueError):
            self._conn.send(message)

    def events(self) -> list[dict[str, Any]]:
        """Every event the child has sent so far (never blocks)."""
        received: list[dict[str, Any]] = []
        while not self._eof:
            try:
                if not self._conn.poll(0):
                    break
                received.append(self._conn.recv())
            except (EOFError, OSError):
                self._eof = True
        return received

    def keep(self) -> None:
        try:
            self._popen.wait()
        finally:
            self._exited.set()


def start_child(plan: TrainingPlan, folder: Path, run_id: str) -> Child:
    """Start a trainer running :mod:`engine.training.child` and hand it the plan over a socket.

    On Linux it is forked from the fork server (:mod:`engine.training.forkserver`), where
    torch and diffusers are imported already; elsewhere, or where the server cannot be
    had, it is a fresh ``python -m engine.training.child``. Not ``multiprocessing``: its
    spawn would re-run the host's ``__main__`` in the child (see
    :mod:`engine.training.child`). The child gets its own session, so a terminal's
    Ctrl-C reaches only the CLI.
    """
    child = _forked_child(run_id)
    if child is None:  # no server to be had: a fresh interpreter, as everywhere else
        child = _spawned_child(run_id)
    child.send([p for p in sys.path if p])
    child.send((plan, str(folder)))
    return child


def _forked_child(run_id: str) -> Child | None:
    from engine.training.forkserver import fork_if_available

    parent_end, child_end = socket.socketpair()
    try:
        forked = fork_if_available("trainer", (child_end.fileno(),), (), child_env())
        child = Child(forked, Connection(os.dup(parent_end.fileno()))) if forked is not None else None
    finally:
        child_end.close()
        parent_end.close()
    if child is not None:
        threading.Thread(target=child.keep, name=f"diffusion-engine-train-{run_id}-keeper", daemon=True).start()
    return child


def _spawned_child(run_id: str) -> Child:
    """``python -m engine.training.child``, kept by a thread that lives as long as it."""
    return start_kept("engine.training.child", f"diffusion-engine-train-{run_id}-keeper", Child, Child.keep)
