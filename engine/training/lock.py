"""Which process is training: process identities and the run lock.

One GPU, one trainer. Inside one engine the job reservation enforces that;
across processes (a server restarted while its trainer child still runs, a
second server on the same runs folder) only something on disk can. The run
lock is a small JSON file, ``<runs_dir>/.train.lock``, naming the engine that
took it and, once started, its trainer child. A lock whose processes are
all gone is stale and is taken over; a lock whose trainer is alive is
honoured, whoever holds it.

A PID alone can be reused by an unrelated process after the trainer died,
so a :class:`ProcessId` also carries the process's start time (from
``/proc`` on Linux; elsewhere the PID check is all there is).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field

from engine import stored
from engine.training import json_files

LOCK_NAME = ".train.lock"


@dataclass(frozen=True)
class ProcessId:
    """A process as it was when recorded: PID plus start time (clock ticks since boot)."""

    #: Validated when read back: a pid of 0 or below would signal a process group (os.kill).
    pid: Annotated[int, Field(ge=1, le=2**31 - 1)]
    started: Annotated[int, Field(ge=0)] | None = None

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        stat = _proc_stat(pid)
        return cls(pid, stat[1] if stat is not None else None)

    @classmethod
    def current(cls) -> ProcessId:
        return cls.of(os.getpid())

    def alive(self) -> bool:
        """Whether this very process still runs (not a zombie, not a reused PID).

        Where liveness cannot be checked (Windows, where signal 0 would kill),
        the answer is True: the caller then honours the record or lock.
        """
        if os.name == "nt":
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it exists, owned by another user
        stat = _proc_stat(self.pid)
        if stat is None:
            return not Path("/proc/self/stat").exists()  # no /proc: the signal check is all we have
        state, started = stat
        if state in ("Z", "X"):
            return False  # exited, waiting to be reaped: it holds no GPU
        return self.started is None or started == self.started


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) from ``/proc/<pid>/stat``, or None when unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rfind(")") + 2:].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


#: A run id as read back from a record or the lock: a plain name (it names the run's folder).
RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")]


@dataclass(frozen=True)
class LockHolder:
    """What the lock file says: who took it, for which run, and its trainer once started."""

    token: Annotated[str, Field(max_length=64)]
    run_id: RunId
    folder: Annotated[str, Field(max_length=4096)]
    owner: ProcessId
    trainer: ProcessId | None = None

    def alive(self) -> bool:
        """Held while the trainer lives; before the trainer starts, while its engine lives."""
        return self.trainer.alive() if self.trainer is not None else self.owner.alive()

    def describe(self) -> str:
        who = self.trainer or self.owner
        role = "trainer" if self.trainer is not None else "engine"
        return f"run {self.run_id} ({self.folder}), {role} process {who.pid}"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class RunLock:
    """The one-trainer-per-runs-folder lock. Safe between threads and processes.

    Every read-decide-write happens under an exclusive ``flock`` on the runs
    folder (the kernel drops it if the process dies), so two engines taking
    over one stale lock cannot both win.
    """

    def __init__(self, runs_dir: Path) -> None:
        self.path = Path(runs_dir) / LOCK_NAME

    def acquire(self, run_id: str, folder: Path) -> tuple[str | None, LockHolder | None]:
        """Take the lock for ``run_id``.

        :return: ``(token, None)`` when taken (a stale lock is taken over), or
            ``(None, holder)`` when a live process holds it.
        :raises OSError: the runs folder cannot be written (full disk, permissions).
        """
        with self._guard():
            holder = self._read()
            if holder is not None and holder.alive():
                return None, holder
            token = uuid.uuid4().hex
            self._write(LockHolder(token, run_id, str(folder), ProcessId.current()))
            return token, None

    def set_trainer(self, token: str, pid: int) -> None:
        """Name the trainer child, so the lock outlives this engine exactly as long as it."""
        with self._guard():
            holder = self._read()
            if holder is not None and holder.token == token:
                self._write(LockHolder(holder.token, holder.run_id, holder.folder, holder.owner, ProcessId.of(pid)))

    def release(self, token: str) -> None:
        """Drop the lock if it is still ``token``'s (never one a newer run took over)."""
        with self._guard():
            holder = self._read()
            if holder is not None and holder.token == token:
                self.path.unlink(missing_ok=True)

    def holder(self) -> LockHolder | None:
        """The current holder, live or stale; None when there is no readable lock."""
        return self._read()

    def _read(self) -> LockHolder | None:
        try:
            return stored.read_record(self.path, LockHolder, root=self.path.parent)
        except stored.UnreadableRecord:
            return None  # unreadable or foreign: nobody we can name holds it

    def _write(self, holder: LockHolder) -> None:
        json_files.write_json_atomic(self.path, holder.to_dict())

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """An exclusive ``flock`` on the runs folder itself (no stray guard file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # no flock (Windows): the in-process job reservation still holds
            yield
            return
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            yield
        finally:
            os.close(folder)  # closing drops the flock
