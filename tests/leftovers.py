"""A pytest plugin: a test that fails (or forgets) while a trainer runs leaves none running.

A trainer is a real process (forked from the engine's fork server, or ``python -m
engine.training.child``). A resume or
server test that regresses fails before its ``wait`` or ``cancel``, and the child went on
training into the next module's fixtures, on the same two cores, for minutes. After each
test, every trainer child it started that is still alive is stopped (SIGTERM, then SIGKILL)
and named in the test's report. Registered by ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import pytest

#: The module a trainer started as a fresh interpreter runs (engine/training/process.py).
TRAINER = "engine.training.child"
#: The fork server's module: its children are trainers (engine/training/forkserver.py);
#: the server itself stays warm for the next test's trainer.
FORKSERVER = "engine.training.forkserver"


def running_trainers() -> dict[int, psutil.Process]:
    """This process's trainers that are alive, by pid: its own trainer children and
    those its fork server forked."""
    found = {}
    for child in psutil.Process().children():
        try:
            command = child.cmdline()
            forked = child.children() if FORKSERVER in command else []
            trainers = [child] if TRAINER in command else forked
            for trainer in trainers:
                if trainer.status() != psutil.STATUS_ZOMBIE:
                    found[trainer.pid] = trainer
        except psutil.Error:  # gone meanwhile
            continue
    return found


def stop(processes: list[psutil.Process], grace_s: float = 10.0) -> list[int]:
    """Terminate ``processes`` (and kill what outlives ``grace_s``); their pids."""
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=grace_s)
    return [process.pid for process in processes]


@pytest.fixture(autouse=True)
def no_trainer_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    before = set(running_trainers())  # a longer-lived fixture's trainer is its own to stop
    yield
    left = [process for pid, process in running_trainers().items() if pid not in before]
    if left:
        stopped = stop(left)
        request.node.add_report_section("teardown", "leftovers", f"stopped trainer processes left running: {stopped}")
