"""Multi-GPU training (``gpus`` > 1): the trainer child launches its ranks through accelerate.

Why this launcher, and not ``accelerate launch`` (``torch.distributed.run``)
as a subprocess: the trainer child (:mod:`engine.training.child`) owns the
one socket to the engine and dies with the engine. ``accelerate launch``
starts every rank as a fresh ``python -m`` process with its file
descriptors closed, under torch's elastic agent: rank 0 would need a second
channel back, and the agent reports the first failure *it notices*, which
is often a survivor's broken collective rather than the rank that died.

So, as accelerate's own ``notebook_launcher`` / ``debug_launcher`` do, the
child forks its ranks with torch's ``start_processes`` through accelerate's
``PrepareForLaunch`` and ``patch_environment`` (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``). Each rank builds an
``Accelerator``, which sets up the process group from that environment
(gloo on CPU, NCCL on CUDA) and its device; there is no process-group code
here. Forking is what keeps the engine's guarantees:

* rank 0 inherits the socket: it sends the events and reads stop requests
  itself, then broadcasts each stop decision to the others
  (:meth:`~engine.training.replicas.Replicas.stop`);
* each rank dies with its launcher (parent-death signal and watch), as the
  launcher dies with the engine: killing either leaves no rank behind;
* the launcher sees every rank's exit status: when one fails it gives the
  others :data:`GRACE_S` to fail on their own (their collectives break at
  once), kills what is left, and reports the rank that failed first on its
  own (:func:`root_cause`) as the run's error. Only the launcher reports
  errors, and only after every rank has exited, so nothing else writes to
  the socket then.

The launcher must not touch CUDA before forking (accelerate's rule for
fork): it imports the trainer (no device) so the ranks start warm.
Several machines (``nodes`` > 1): each node's trainer child launches its own ranks
the same way, with global ranks ``node_rank * gpus + i`` meeting at node 0's
``main_address``; every node preflighted its own devices in its engine before
this. Rank 0 writes the run; each other node's first rank speaks for that node
(its progress, and the stop requests its engine gets, which reach every rank).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Any

from engine import stored
from engine.network import free_loopback_port

#: Seconds the other ranks get to fail on their own once one rank failed.
GRACE_S = 20.0


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended: its exit code, the error it wrote (if any), whether the launcher killed it."""

    rank: int
    pid: int
    exitcode: int | None
    error: dict[str, Any] | None = None
    killed: bool = False

    @property
    def failed(self) -> bool:
        return self.exitcode != 0

    @property
    def primary(self) -> bool:
        """Failed on its own: its own error, or killed from outside (not by us, not a lost peer)."""
        if not self.failed or self.killed:
            return False
        return self.error is None or not self.error.get("peer_lost", False)

    def describe(self, world: int) -> str:
        who = f"rank {self.rank} of {world} (pid {self.pid})"
        if self.error is not None:
            return f"{who} failed: {self.error['message']}"
        code = self.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "an unknown signal"
            return f"{who} was killed by signal {-code} ({name})"
        return f"{who} ended without finishing (exit code {code})"


def launch(plan: Any, folder: Path, channel: Any) -> None:
    """Run ``plan`` on ``plan.config.gpus`` ranks; every failure becomes one error event."""
    import torch.multiprocessing as torch_mp
    from accelerate.utils import PrepareForLaunch, patch_environment

    import engine.training.trainer  # noqa: F401  (imported once here: the forked ranks share it)

    config = plan.config
    local, nodes, node = int(config.gpus), int(getattr(config, "nodes", 1)), int(getattr(config, "node_rank", 0))
    world = local * nodes
    if nodes > 1:  # every node's ranks meet at node 0's address (torch's TCP rendezvous)
        host, _, port = str(config.main_address).rpartition(":")
    else:
        host, port = "127.0.0.1", str(free_loopback_port())
    # The ranks' error records: in the run's own folder, so a launcher killed with its engine
    # (no ``finally``) leaves them with the run, not in the machine's temporary folder.
    errors = Path(tempfile.mkdtemp(prefix=".ranks-", dir=folder))
    kind = "MULTI_CPU" if plan.device == "cpu" else "MULTI_GPU"
    try:
        with patch_environment(nproc=local, node_rank=node, world_size=world, master_addr=host, master_port=port):
            context = torch_mp.start_processes(
                PrepareForLaunch(_rank, distributed_type=kind),
                args=(plan, str(folder), channel, str(errors), os.getpid()),
                nprocs=local, join=False, start_method="fork",
            )
        ends = _wait_all(context.processes, errors, first=node * local)
        for name in context.error_files:  # torch's own copy of a failed rank's traceback (ours is read)
            Path(name).unlink(missing_ok=True)
    except Exception as exc:  # the ranks could not be started: the run's error, reported
        channel.emit({"type": "error", "code": "trainer_start_failed",
                      "message": f"the {world} ranks could not start under accelerate: {type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)})
        return
    finally:
        shutil.rmtree(errors, ignore_errors=True)
    cause = root_cause(ends)
    if cause is not None:
        others = [e.rank for e in ends if e.failed and e.rank != cause.rank]
        message = cause.describe(world) + (f"; ranks {others} were stopped with it" if others else "")
        code = str((cause.error or {}).get("code", "rank_failed"))
        if nodes > 1 and (cause.error or {}).get("peer_lost"):  # this node's ranks are fine: another's are gone
            code = "node_lost"
            message = (f"node {node} of {nodes} lost the ranks of another node (it died, or the link to it "
                       f"broke); its own ranks stopped: {message}")
        channel.emit({"type": "error", "code": code, "message": message,
                      "traceback": (cause.error or {}).get("traceback", "")})


def root_cause(ends: list[RankEnd]) -> RankEnd | None:
    """The rank whose failure ended the run: the first (in exit order) that failed on its own,
    else the first that failed at all; None when every rank finished."""
    failed = [e for e in ends if e.failed]
    primary = [e for e in failed if e.primary]
    return (primary or [e for e in failed if not e.killed] or failed or [None])[0]


def _wait_all(processes: list[Any], errors: Path, first: int = 0) -> list[RankEnd]:
    """Wait for this node's ranks (global ranks from ``first``), in exit order; once one failed,
    the rest get :data:`GRACE_S`, then SIGKILL."""
    pending = {p.sentinel: rank for rank, p in enumerate(processes)}
    killed: set[int] = set()
    deadline: float | None = None
    ends: list[RankEnd] = []
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait_ready(list(pending), timeout=timeout)
        if not ready and deadline is not None:
            for rank in pending.values():
                processes[rank].kill()
                killed.add(rank)
            deadline = None  # now wait for the kills to land
            continue
        for sentinel in ready:
            rank = pending.pop(sentinel)  # type: ignore[call-overload]
            process = processes[rank]
            process.join()
            ends.append(RankEnd(first + rank, process.pid, process.exitcode, _read_error(errors, first + rank),
                                rank in killed))
            if process.exitcode != 0 and deadline is None and not killed:
                deadline = time.monotonic() + GRACE_S
    return ends


def _rank(plan: Any, folder: str, channel: Any, errors: str, launcher_pid: int) -> None:
    """One rank (forked): die with the launcher, join the group through accelerate, train."""
    from engine.training.lineage import die_with_parent

    die_with_parent(launcher_pid)
    rank = int(os.environ.get("RANK", "0"))
    try:
        from accelerate.utils import gather_object

        from engine.logs import quiet_library_logs
        from engine.training.replicas import join
        from engine.training.trainer import run_training

        quiet_library_logs(progress_bars=False)
        if plan.device == "cpu":  # share the cores: N ranks each spinning on all of them crawl
            import torch

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(plan.config.gpus)))
        replicas = join(plan.device, plan.config.join_timeout)
        with replicas.collective():
            pids = [int(p) for p in gather_object([os.getpid()])]
        nodes = int(getattr(plan.config, "nodes", 1))
        if replicas.main:
            channel.emit({"type": "phase", "phase": "starting",
                          "message": f"{replicas.world} ranks up under accelerate "
                                     f"({replicas.accelerator.distributed_type})"
                                     + (f" on {nodes} nodes" if nodes > 1 else ""),
                          "ranks": {"world": replicas.world, "pids": pids, "nodes": nodes}})
        elif replicas.speaker:  # another node's first rank: its engine follows the run; node 0 writes it
            channel.emit({"type": "phase", "phase": "starting",
                          "message": f"node {plan.config.node_rank} of {nodes}: its ranks joined the run of "
                                     f"node 0 ({plan.config.main_address}), which writes the LoRA and checkpoints",
                          "ranks": {"world": replicas.world, "pids": pids, "nodes": nodes}})
        result = run_training(plan, Path(folder), channel.emit if replicas.speaker else _ignore,
                              channel.should_stop if replicas.speaker else _go_on, replicas=replicas)
        if replicas.speaker:
            channel.emit(result)
    except BaseException as exc:
        _write_error(Path(errors), rank, exc)
        raise


def _write_error(errors: Path, rank: int, exc: BaseException) -> None:
    from engine.training.records import error_event
    from engine.training.replicas import PeerLost

    record = {**error_event(exc), "peer_lost": isinstance(exc, PeerLost)}
    try:
        (errors / f"rank-{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    except OSError:
        pass  # the launcher still reports the rank, by its exit status


def _read_error(errors: Path, rank: int) -> dict[str, Any] | None:
    try:
        return dict(stored.read_json(errors / f"rank-{rank}.json", root=errors))
    except (OSError, ValueError):
        return None


def _ignore(event: dict[str, object]) -> None:
    """Ranks other than each node's first say nothing: rank 0 speaks for the run, and
    another node's first rank for that node's engine."""


def _go_on() -> str | None:
    return None  # only each node's first rank reads stop requests; every rank gets the decision

