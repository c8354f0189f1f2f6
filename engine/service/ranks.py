"""One request on several ranks: the engine starts them, hands each the request, returns rank 0's result.

A ticket whose plan splits it (:mod:`engine.policy.parallel`) runs here instead of on the
loaded model. The engine starts ``ranks`` processes, each of which dies with the engine: on
Linux forked from the engine's fork server (:mod:`engine.training.forkserver`, where torch and
diffusers are imported already, as its trainers are), elsewhere fresh interpreters; never forks
of the engine itself, which may hold a CUDA context and server threads a fork must not copy.
Each rank joins the process group on the loopback interface through the trainer's
bounded rendezvous (:func:`engine.training.rendezvous.rendezvous`: gloo on a CPU, NCCL on
GPUs, one GPU a rank), builds an engine of its own, checks and loads the same request the
way one process would (its own plan, the split taken out), splits its denoisers
(:func:`engine.runtime.parallel.split_denoisers`) and renders; every rank renders the same
result, and rank 0 sends it back with its progress.

A rank that dies (killed, out of memory) fails the job with ``rank_lost`` naming it: the
engine notices its exit at once, kills the others (their collectives would wait for it) and
raises; the engine and its server live on and the next job starts fresh ranks. A cancel
kills the ranks (they cannot stop at one step together) and raises
:class:`~engine.errors.Cancelled`. Ranks load the model per job: the one-process loaded slot
and its keep-alive do not apply to a split request.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait as wait_ready
from typing import Any, Protocol

from engine.errors import Cancelled, EngineError
from engine.network import free_loopback_port

__all__ = ["RankJob", "RankLost", "rank_job", "rank_pids", "run_on_ranks", "split_status", "splits"]

#: Seconds every rank waits for the others to join before the job fails.
JOIN_TIMEOUT_S = 120.0
#: Seconds the other ranks get to finish once rank 0 has sent its result.
FINISH_S = 10.0


class RankLost(EngineError):
    """A rank of a split request died before the request finished."""

    code = "rank_lost"


@dataclass(frozen=True)
class RankJob:
    """What each rank is handed: the request as it was asked, the split, and the machine."""

    #: The ticket's ``asked``: (body, door, uploads, load options, seconds).
    asked: tuple[Any, ...]
    #: The plan's :class:`~engine.policy.parallel.ParallelChoice`.
    choice: Any
    #: The denoiser components to split (the denoiser and its experts).
    denoisers: tuple[str, ...]
    #: The controls each rank's own plan takes as the split decided them (step cache off...).
    controls: tuple[tuple[str, object], ...]
    allow_download: bool


def run_on_ranks(job: RankJob, progress: Callable[[int, int], None] | None = None,
                 cancel: threading.Event | None = None) -> Any:
    """Run ``job`` on its ranks; rank 0's result (images, or a :class:`~engine.service.videos.Video`).

    Each rank runs :mod:`engine.service.rank_worker`, forked from the fork server or a fresh
    interpreter (never multiprocessing's spawn, which re-runs the caller's main script: an app's
    script without a ``__main__`` guard would start itself again), handed the job and answering
    over a pipe of its own.

    :raises RankLost: a rank died; :class:`Cancelled`: ``cancel`` was set; a rank's own
        refusal is raised with its code."""
    port = free_loopback_port()
    ranks: list[_Rank] = []
    pids: dict[int, int] = {}
    _RUNNING.append(pids)
    try:
        for rank in range(job.choice.ranks):
            ranks.append(_start(rank, job, port))
            pids[rank] = ranks[-1].process.pid
        result = _follow(ranks, progress, cancel or threading.Event())
    except BaseException:
        _stop(ranks, grace=0.0)  # the others wait in a collective for the one that is gone
        raise
    finally:
        _RUNNING.remove(pids)
    _stop(ranks, grace=FINISH_S)
    return result


#: Each running split request's ranks (rank -> PID); an engine runs one at a time, a process may
#: hold several engines.
_RUNNING: list[dict[int, int]] = []


def rank_pids() -> dict[int, int]:
    """The PIDs of this process's running split request's ranks, by rank (empty while none runs;
    where several engines split requests at once, the one started first)."""
    return dict(_RUNNING[0]) if _RUNNING else {}


class _Process(Protocol):
    """A rank's process: a :class:`subprocess.Popen`, or one the fork server forked."""

    pid: int

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


@dataclass
class _Rank:
    """One started rank: its process and the end of the pipe it answers on."""

    rank: int
    process: _Process
    reader: Connection


def _start(rank: int, job: RankJob, port: int) -> _Rank:
    job_read, job_write = os.pipe()
    answer_read, answer_write = os.pipe()
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(job.choice.ranks),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    try:
        process = _launch(rank, (job_read, answer_write), env)
    finally:
        os.close(job_read)
        os.close(answer_write)
    with Connection(job_write, readable=False) as sender:
        sender.send(job)
    return _Rank(rank, process, Connection(answer_read, writable=False))


def _launch(rank: int, fds: tuple[int, int], env: dict[str, str]) -> _Process:
    """``engine.service.rank_worker JOB_FD ANSWER_FD RANK PARENT_PID``: forked from the fork
    server where there is one (no import of torch and diffusers per rank), else a fresh interpreter."""
    from engine.training.forkserver import fork_if_available

    forked = fork_if_available("rank", fds, (str(rank),), env)
    if forked is not None:
        return forked
    command = [sys.executable, "-m", "engine.service.rank_worker", *map(str, fds), str(rank), str(os.getpid())]
    return subprocess.Popen(command, pass_fds=fds, env=env, stdin=subprocess.DEVNULL)


def _follow(ranks: list[_Rank], progress: Callable[[int, int], None] | None, cancel: threading.Event) -> Any:
    """Read the ranks until rank 0's result, a rank's error, a rank's end or a cancel. A rank's
    pipe closes when it exits (nothing else holds its end), so its end is an end of file here."""
    world = len(ranks)
    by_reader: dict[Any, _Rank] = {r.reader: r for r in ranks}
    running: list[Any] = [r.reader for r in ranks]
    while True:
        if cancel.is_set():
            raise Cancelled(f"the generate was cancelled; its {world} ranks were stopped")
        for reader in wait_ready(running, timeout=0.2):
            rank = by_reader[reader]
            try:
                message = rank.reader.recv()
            except EOFError:
                code = _exit(rank.process)
                if code == 0 and rank.rank != 0:  # rendered its share; rank 0 sends the result
                    running.remove(reader)
                    continue
                raise RankLost(f"rank {rank.rank} of {world} (pid {rank.process.pid}) {_how(code)} "
                               "before the request finished; the job failed and its other ranks were stopped: "
                               "the next request starts fresh ranks") from None
            kind = message[0]
            if kind == "progress" and progress is not None:
                progress(*message[1:])
            elif kind == "done":
                return message[1]
            elif kind == "error":
                _, code, text = message
                raise EngineError(f"rank {rank.rank} of {world}: {text}" if code == "rank_failed" else text,
                                  code=code)


def _exit(process: _Process, timeout: float = 5.0) -> int | None:
    """``process``'s exit code, or None where it has not ended in ``timeout`` seconds."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        import signal

        try:
            return f"was killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"ended (exit code {exitcode})"


def _stop(ranks: list[_Rank], *, grace: float) -> None:
    """Give the ranks ``grace`` seconds to leave, then kill what is left."""
    deadline = time.monotonic() + grace
    for rank in ranks:
        if _exit(rank.process, max(0.0, deadline - time.monotonic())) is None:
            rank.process.kill()
            rank.process.wait()
        rank.reader.close()


def splits(ticket: Any) -> bool:
    """Whether ``ticket``'s plan runs it on several ranks."""
    choice = ticket.plan.parallel
    return choice is not None and choice.ranks > 1


def rank_job(ticket: Any, allow_download: bool) -> RankJob:
    """What each rank of a split ticket is handed."""
    plan = ticket.plan
    layout = ticket.target.family.pipeline
    controls = tuple((field, str(plan.value(key))) for field, key in (("step_cache", "step_cache"),
                                                                      ("compile", "compile"))
                     if plan.value(key) == "off")
    return RankJob(asked=ticket.asked, choice=plan.parallel, denoisers=(layout.denoiser, *layout.experts),
                   controls=controls, allow_download=allow_download)


def split_status(ticket: Any) -> dict[str, object]:
    """What a load of a split ticket reports: its plan and split, nothing loaded (its ranks load
    their own copies at the generate)."""
    return {"model": ticket.target.key, "family": ticket.target.family.name, "loaded": False,
            "plan": ticket.plan.to_dict(), "parallel": ticket.plan.parallel.to_dict(), "loras": {"applied": []}}
