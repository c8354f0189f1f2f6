"""``python -m engine.service.rank_worker JOB_FD ANSWER_FD RANK PARENT_PID``: one rank of a split request.

Started by :func:`engine.service.ranks.run_on_ranks` (forked from the fork server, or a fresh
interpreter), never by hand: it reads its job from
``JOB_FD`` and answers on ``ANSWER_FD`` (pipes the engine opened for it): its progress (rank
0), the result (rank 0), or its error. The rank builds an engine of its own and checks and
loads the request as one process would (its own plan, the split taken out and the controls the
split decided kept), then splits the loaded denoisers (:func:`engine.runtime.parallel.split_denoisers`)
and renders; every rank renders the same result.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from engine.errors import EngineError
from engine.service.ranks import JOIN_TIMEOUT_S, RankJob


def main(argv: list[str] | None = None) -> None:
    job_fd, answer_fd, rank, parent = (int(value) for value in (argv or sys.argv[1:]))
    rank_main(rank, job_fd, answer_fd, parent)


def rank_main(rank: int, job_fd: int, answer_fd: int, parent_pid: int) -> None:
    """Die with the engine, read the job, join the group, render, say how it went."""
    from engine.training.lineage import die_with_parent

    die_with_parent(parent_pid)
    with Connection(job_fd, writable=False) as reader:
        job: RankJob = reader.recv()
    with Connection(answer_fd, readable=False) as sender:
        try:
            result = _render(rank, job, sender)
            if rank == 0:
                sender.send(("done", result))
        except EngineError as exc:
            sender.send(("error", exc.code, exc.message))
        except BaseException as exc:  # a rank's crash is the job's error, said with its kind
            sender.send(("error", "rank_failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))


def _render(rank: int, job: RankJob, sender: Connection) -> Any:
    import torch

    from engine.logs import quiet_library_logs
    from engine.runtime.parallel import split_denoisers
    from engine.service.facade import Engine
    from engine.service.generating import LoadOptions
    from engine.training.rendezvous import rendezvous

    quiet_library_logs(progress_bars=False)
    choice = job.choice
    if choice.device == "cuda":
        torch.cuda.set_device(rank)
    rendezvous("nccl" if choice.device == "cuda" else "gloo", JOIN_TIMEOUT_S)
    body, output, uploads, load, seconds = job.asked
    load = load or LoadOptions()
    request = dataclasses.replace(load.request, gpus=None, parallel="auto", **dict(job.controls))
    if choice.device == "cpu" and request.threads is None:  # the ranks share the cores
        request = dataclasses.replace(request, threads=max(1, (os.cpu_count() or 1) // choice.ranks))
    step = (lambda done, total: sender.send(("progress", done, total))) if rank == 0 else None
    with Engine(allow_download=job.allow_download) as engine:
        door = engine.videos if output == "frames" else engine.images
        extra = {"seconds": seconds} if output == "frames" else {}
        ticket = door.check_generate(body, uploads=uploads, base=load.base, family=load.family, request=request,
                                     controlnet=load.controlnet, **extra)
        door.load(ticket)
        session: Any = engine.loaded.session
        split = split_denoisers(session.pipeline, choice, job.denoisers)
        made: Any = door.generate(ticket, progress=step)
    if output == "frames":  # the clip's recipe says how it was split, as the ranks split it
        made = dataclasses.replace(made, recipe={**made.recipe, "parallel": {**choice.to_dict(), "split": split}})
    return made


if __name__ == "__main__":
    main()
