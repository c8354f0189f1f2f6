"""The trainer's process: how it starts, the socket it talks on, and how it
dies with its parent.

The rules are those of :mod:`engine.training.runner` (which watches the
run): the child has its own session and ignores the terminal's SIGINT; it
asks the kernel for SIGKILL when its parent goes (``PR_SET_PDEATHSIG``,
Linux) and watches the parent PID everywhere; the kernel ties that signal
to the thread that spawned the child, so a keeper thread that lives as
long as the child starts it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.training.forkserver import Forked
    from engine.training.preflight import TrainingPlan

#: The folder that holds the ``engine`` package: the child imports it from there.
ENGINE_ROOT = Path(__file__).resolve().parents[2]

#: How often the child's parent watch looks at the parent PID (seconds).
PARENT_CHECK_S = 0.25
#: Exit status of a child that ended because its parent was gone.
ORPHAN_EXIT = 75


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


def child_env() -> dict[str, str]:
    """The environment a trainer (or the fork server) gets: this process's, with the
    folder that holds the ``engine`` package first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ENGINE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def start_child(plan: TrainingPlan, folder: Path, run_id: str) -> Child:
    """Start a trainer running :mod:`engine.training.child` and hand it the plan over a socket.

    On Linux it is forked from the fork server (:mod:`engine.training.forkserver`), where
    torch and diffusers are imported already; elsewhere, or where the server cannot be
    had, it is a fresh ``python -m engine.training.child``. Not ``multiprocessing``: its
    spawn would re-run the host's ``__main__`` in the child (see
    :mod:`engine.training.child`). The child gets its own session, so a terminal's
    Ctrl-C reaches only the CLI.
    """
    from engine.training import forkserver

    child = None
    if forkserver.available():
        try:
            child = _forked_child(forkserver.server(), run_id)
        except OSError:
            child = None  # no server to be had: a fresh interpreter, as everywhere else
    if child is None:
        child = _spawned_child(run_id)
    child.send([p for p in sys.path if p])
    child.send((plan, str(folder)))
    return child


def _forked_child(server: Any, run_id: str) -> Child:
    parent_end, child_end = socket.socketpair()
    try:
        forked = server.fork(child_end.fileno(), child_env(), os.getcwd(), [p for p in sys.path if p])
        child = Child(forked, Connection(os.dup(parent_end.fileno())))
    finally:
        child_end.close()
        parent_end.close()
    threading.Thread(target=child.keep, name=f"diffusion-engine-train-{run_id}-keeper", daemon=True).start()
    return child


def _spawned_child(run_id: str) -> Child:
    """``python -m engine.training.child``, started from a keeper thread that lives as long as
    the child (the parent-death signal follows the spawning thread)."""
    parent_end, child_end = socket.socketpair()
    command = [sys.executable, "-m", "engine.training.child", str(child_end.fileno()), str(os.getpid())]
    options: dict[str, Any] = {"start_new_session": True} if os.name == "posix" else {
        "creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)}  # no terminal SIGINT reaches it
    env = child_env()
    failure: list[BaseException] = []
    launched = threading.Event()
    holder: list[Child] = []

    def keep() -> None:
        try:
            process = subprocess.Popen(command, pass_fds=(child_end.fileno(),), env=env, **options)
            holder.append(Child(process, Connection(os.dup(parent_end.fileno()))))
        except BaseException as exc:  # handed to the caller below, re-raised there
            failure.append(exc)
            return
        finally:
            child_end.close()
            parent_end.close()
            launched.set()
        holder[0].keep()

    threading.Thread(target=keep, name=f"diffusion-engine-train-{run_id}-keeper", daemon=True).start()
    launched.wait()
    if failure:
        raise failure[0]
    return holder[0]


def die_with_parent(parent_pid: int) -> None:
    """Make this (child) process end when ``parent_pid`` does, however the parent ends.

    SIGKILL/SIGTERM of a server or CLI runs no cleanup in it, so the child
    must notice on its own: the kernel's parent-death signal on Linux, and a
    watch thread everywhere (the parent pipe closes, or we get reparented).
    """
    if sys.platform.startswith("linux"):
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(ORPHAN_EXIT)  # the parent died before the signal was armed
    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None

    def watch() -> None:
        while os.getppid() == parent_pid:
            if sentinel is not None:
                if wait_ready([sentinel], timeout=PARENT_CHECK_S):
                    break
            else:
                time.sleep(PARENT_CHECK_S)
        os._exit(ORPHAN_EXIT)  # no cleanup: there is nobody left to report to

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def set_parent_death_signal(signum: int) -> None:
    """Ask the kernel (Linux) to send ``signum`` to this process when its parent's
    spawning thread ends."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl (an unusual libc): the watch thread still ends the child
