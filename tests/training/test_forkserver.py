"""Trainers forked from a warm server (engine/training/forkserver.py): the same server for
every run of an engine process, each trainer in its own session and in the engine's
present environment, a fresh server where an import-time variable changed, and the
fresh interpreter where the server is switched off."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from engine import Engine
from engine.hardware.probe import probe
from engine.testing.datasets import write_dataset
from engine.training import forkserver

pytestmark = pytest.mark.skipif(not forkserver.available(), reason="the fork server is Linux's")


def finish(engine: Engine) -> dict[str, object]:
    deadline = time.monotonic() + 240
    while True:
        status = engine.training.status() or {}
        if status.get("status") in ("completed", "failed", "cancelled", "stopped"):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def started(engine: Engine, config: dict[str, object]) -> psutil.Process:
    engine.training.start(config)
    return psutil.Process(int(engine.training.status()["pid"]))  # type: ignore[index, arg-type]


@pytest.fixture
def config(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> dict[str, object]:
    data = write_dataset(tmp_path / "data", count=2, size=64)
    return {"base_model": str(tiny_pipeline("sdxl")), "dataset_dir": str(data), "resolution": 64, "steps": 2,
            "lora_rank": 2, "device": "cpu"}


@pytest.mark.slow
def test_runs_fork_from_one_warm_server_in_the_engines_present(
    config: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    first = started(engine, config)
    server = first.parent()
    assert server is not None and forkserver.__name__ in server.cmdline()
    assert server.ppid() == os.getpid()  # the server is this engine's child, the trainer its
    assert os.getsid(first.pid) == first.pid  # a session of its own: no terminal's Ctrl-C reaches it
    assert finish(engine)["status"] == "completed"
    # The next run's trainer forks from the same server, yet reads the environment the
    # engine has now: its captions are cached where the variable set since then says.
    cache = tmp_path / "prompt-cache-set-later"
    monkeypatch.setenv("DIFFUSION_ENGINE_PROMPT_CACHE", str(cache))
    second = started(engine, config)
    assert second.parent().pid == server.pid and second.pid != first.pid  # type: ignore[union-attr]
    assert finish(engine)["status"] == "completed"
    assert any(cache.rglob("*")), "the trainer did not see the variable the engine set after the server started"


@pytest.mark.slow
def test_a_changed_import_time_variable_gets_a_fresh_server_and_a_killed_trainer_reads_as_killed(
    config: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = forkserver.server().pid
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read by torch when imported: the old server cannot honour it
    trainer = started(engine, {**config, "steps": 100000})
    after = trainer.parent().pid  # type: ignore[union-attr]
    assert after != before
    deadline = time.monotonic() + 10
    while psutil.pid_exists(before) and psutil.Process(before).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the stale server was left running"
        time.sleep(0.05)
    os.kill(trainer.pid, signal.SIGKILL)  # the server reaps it and sends its status back
    status = finish(engine)
    error = status["error"]
    assert status["status"] == "failed" and error["code"] == "trainer_died", error  # type: ignore[index]
    assert "killed by signal 9" in error["message"], error  # type: ignore[index]


@pytest.mark.slow
def test_switched_off_every_trainer_is_a_fresh_interpreter(
    config: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(forkserver.ENV_SWITCH, "0")
    engine = Engine(hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    trainer = started(engine, config)
    assert trainer.ppid() == os.getpid() and "engine.training.child" in trainer.cmdline()
    assert finish(engine)["status"] == "completed"


@pytest.mark.slow
def test_a_forked_trainer_writes_where_the_engine_writes_now() -> None:
    """The server keeps the stderr it started with (another test's capture, a terminal since
    closed); a trainer's traceback goes to the engine's stderr as it points now."""
    import socket
    import sys
    from multiprocessing.connection import Connection

    server = forkserver.server()  # started (or warm) with this process's stderr as it was
    read_end, write_end = os.pipe()
    saved = os.dup(2)
    os.dup2(write_end, 2)  # the engine's stderr moves after the server started
    try:
        parent_end, child_end = socket.socketpair()
        forked = server.fork("trainer", (child_end.fileno(),), (), dict(os.environ), os.getcwd(), [p for p in sys.path if p])
        child_end.close()
        conn = Connection(parent_end.detach())
        conn.send(12345)  # not the list of paths it expects: it fails before any plan, with a traceback
        assert forked.wait(timeout=60) == 1
        conn.close()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write_end)
    with os.fdopen(read_end, encoding="utf-8", errors="replace") as written:
        text = written.read()
    assert "Traceback" in text and "TypeError" in text, text


def test_a_loaded_gpu_driver_is_named_and_a_clean_map_is_not() -> None:
    """A forked process cannot initialise CUDA once its parent did: the server reads its own
    memory map after its imports."""
    clean = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    cuda = clean + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05\n"
    assert forkserver.gpu_driver_touched(clean, torch_initialised=False) == ""
    assert "libcuda.so" in forkserver.gpu_driver_touched(cuda, torch_initialised=False)
    assert "torch initialised the GPU" in forkserver.gpu_driver_touched(clean, torch_initialised=True)
    with open("/proc/self/maps", encoding="utf-8") as maps:  # this CPU build of torch loads no driver
        assert forkserver.gpu_driver_touched(maps.read(), torch_initialised=False) == ""


@pytest.mark.slow
def test_a_server_that_found_a_gpu_driver_hands_every_later_trainer_to_a_fresh_interpreter(
    config: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys
    from multiprocessing import Pipe

    monkeypatch.setattr(forkserver, "_unusable", "")
    server = forkserver.ForkServer()  # its messages, as a server on a CUDA machine would send them
    ours, theirs = Pipe()
    server._conn, server._process = ours, subprocess.Popen([sys.executable, "-c", "pass"])
    theirs.send(("unusable", "a GPU driver (libcuda.so) was loaded while the server imported its modules"))
    theirs.close()
    server._read_messages()  # until the server's end of the socket closes
    assert not forkserver.available() and not server.alive()
    engine = Engine(hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    trainer = started(engine, config)
    assert trainer.ppid() == os.getpid() and "engine.training.child" in trainer.cmdline()
    assert finish(engine)["status"] == "completed"
