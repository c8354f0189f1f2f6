"""How a trainer process is tied to the engine that started it, wherever it was started.

Shared by the fresh interpreter (:mod:`engine.training.process`), the fork server
(:mod:`engine.training.forkserver`) and the ranks (:mod:`engine.training.launch`): the
environment a child starts with, and the rules by which it dies with its parent (the
kernel's parent-death signal on Linux, a watch of the parent PID everywhere).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Any, TypeVar

from engine.places import child_environment

T = TypeVar("T")

#: The folder that holds the ``engine`` package: the child imports it from there.
ENGINE_ROOT = Path(__file__).resolve().parents[2]

#: How often the child's parent watch looks at the parent PID (seconds).
PARENT_CHECK_S = 0.25
#: Exit status of a child that ended because its parent was gone.
ORPHAN_EXIT = 75


def child_env() -> dict[str, str]:
    """The environment a trainer (or the fork server) gets: this process's less its secrets
    (the server's token), with the folder that holds the ``engine`` package first on ``PYTHONPATH``."""
    return child_environment(PYTHONPATH=os.pathsep.join(
        [str(ENGINE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def start_kept(module: str, name: str, make: Callable[[subprocess.Popen[bytes], Connection], T],
               keep: Callable[[T], None]) -> T:
    """Start ``python -m module FD PARENT_PID`` (FD: its end of a new socket pair) in a
    session of its own, from a thread named ``name`` that then runs ``keep`` on what
    ``make`` built of the process and this side's connection, and so lives as long as
    ``keep`` needs the process: Linux sends the parent-death signal when the *thread* that
    spawned a child ends (a server's request thread may end long before the run)."""
    parent_end, child_end = socket.socketpair()
    command = [sys.executable, "-m", module, str(child_end.fileno()), str(os.getpid())]
    options: dict[str, Any] = {"start_new_session": True} if os.name == "posix" else {
        "creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)}  # no terminal SIGINT reaches it
    env = child_env()
    failure: list[BaseException] = []
    made: list[T] = []
    started = threading.Event()

    def run() -> None:
        try:
            process = subprocess.Popen(command, pass_fds=(child_end.fileno(),), env=env, **options)
            made.append(make(process, Connection(os.dup(parent_end.fileno()))))
        except BaseException as exc:  # handed to the caller below, re-raised there
            failure.append(exc)
            return
        finally:
            child_end.close()
            parent_end.close()
            started.set()
        keep(made[0])

    threading.Thread(target=run, name=name, daemon=True).start()
    started.wait()
    if failure:
        raise failure[0]
    return made[0]


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
