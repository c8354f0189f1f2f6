"""Training runs are reliable: records never lie, and the trainer dies with its parent.

Real runs on tiny pipelines (CPU), real child processes, real signals; the
only thing simulated is a full disk (the record writer raises ENOSPC).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine
from engine.errors import EngineError, PreflightError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.service.facade import Busy
from engine.testing.datasets import write_dataset
from engine.training import json_files
from engine.requests.training import TrainingConfig
from engine.training.lock import LOCK_NAME, ProcessId, RunLock
from engine.training.preflight import preflight_training
from engine.training.records import TERMINAL, RunRecord, list_runs
from tests.support import HostModel

REGISTRY = load_registry()
ROOT = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting to be reaped counts as gone)."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def exited_process() -> ProcessId:
    """The identity of a real process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pid = ProcessId.of(child.pid)
    child.wait()
    return pid


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), count=2)


@pytest.fixture
def config(tiny_pipeline: Callable[[str], Path], dataset: Path) -> dict[str, object]:
    return {"base_model": str(tiny_pipeline("sdxl")), "dataset_dir": str(dataset), "resolution": 64,
            "steps": 2, "lora_rank": 2, "device": "cpu"}


def wait_for_step(engine: Engine, step: int = 1, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while (engine.training.status() or {}).get("step", 0) < step:  # type: ignore[operator]
        assert time.monotonic() < deadline, engine.training.status()
        time.sleep(0.1)


# -- records and the lock, on their own ------------------------------------------


def test_record_left_running_by_a_gone_process_reads_as_failed(tmp_path: Path) -> None:
    dead, dead_engine = exited_process(), exited_process()
    orphan = RunRecord("orphan", tmp_path / "orphan", "sdxl", "base", {}, {}, status="running", step=7, steps=10)
    orphan.set_owner(dead_engine)
    orphan.set_trainer(dead)
    orphan.save()
    never_spawned = RunRecord("never-spawned", tmp_path / "never-spawned", "sdxl", "base", {}, {})
    never_spawned.set_owner(dead_engine)
    never_spawned.save()
    ours = RunRecord("ours", tmp_path / "ours", "sdxl", "base", {}, {}, status="running")
    ours.set_owner(ProcessId.current())  # this process's watcher writes how its runs end
    ours.set_trainer(dead)
    ours.save()
    live = RunRecord("live", tmp_path / "live", "sdxl", "base", {}, {}, status="running")
    live.set_owner(ProcessId.current())
    live.set_trainer(ProcessId.current())  # this test process stands in for a live trainer
    live.save()
    reused = RunRecord("reused", tmp_path / "reused", "sdxl", "base", {}, {}, status="running")
    reused.set_trainer(ProcessId(os.getpid(), (ProcessId.current().started or 0) + 1))  # same PID, other process
    reused.save()
    by_id = {r.run_id: r for r in list_runs(tmp_path)}
    assert by_id["live"].status == "running" and by_id["ours"].status == "running"
    for run_id in ("orphan", "never-spawned", "reused"):
        assert by_id[run_id].status == "failed" and by_id[run_id].error["code"] == "trainer_gone"  # type: ignore[index]
    assert str(dead.pid) in by_id["orphan"].error["message"]  # type: ignore[index]
    on_disk = json.loads(orphan.path.read_text(encoding="utf-8"))
    assert on_disk["status"] == "failed" and on_disk["step"] == 7, "the failure was written back"


def test_run_lock_honours_a_live_trainer_and_takes_over_a_stale_one(tmp_path: Path) -> None:
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        first = RunLock(tmp_path)
        token, holder = first.acquire("run-a", tmp_path / "run-a")
        assert token is not None and holder is None
        first.set_trainer(token, trainer.pid)
        refused, live = RunLock(tmp_path).acquire("run-b", tmp_path / "run-b")
        assert refused is None and live is not None
        assert live.trainer is not None and live.trainer.pid == trainer.pid and "run-a" in live.describe()
    finally:
        trainer.kill()
        trainer.wait()
    taken, stale = RunLock(tmp_path).acquire("run-b", tmp_path / "run-b")
    assert taken is not None and stale is None
    first.release(token)  # the old owner's release must not drop the new holder's lock
    assert RunLock(tmp_path).holder() is not None and RunLock(tmp_path).holder().run_id == "run-b"  # type: ignore[union-attr]
    RunLock(tmp_path).release(taken)
    assert not (tmp_path / LOCK_NAME).exists()


def test_output_dir_holding_a_run_a_folder_or_a_file_is_refused_before_eviction(
    config: dict[str, object], tmp_path: Path
) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    earlier = tmp_path / "earlier-run"
    earlier.mkdir()
    (earlier / "run.json").write_text('{"status": "completed"}', encoding="utf-8")
    (earlier / "pytorch_lora_weights.safetensors").write_bytes(b"precious")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("mine", encoding="utf-8")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine", encoding="utf-8")
    for output, hint in ((earlier, "earlier run"), (notes, "files"), (a_file, "is a file")):
        with pytest.raises(PreflightError) as raised:
            engine.training.start({**config, "output_dir": str(output)})
        assert raised.value.code == "output_exists" and str(output) in raised.value.message
        assert hint in raised.value.message
    assert host.evicted == 0 and engine.residency.owner is None and engine.status()["job"] is None
    assert (earlier / "pytorch_lora_weights.safetensors").read_bytes() == b"precious"
    assert (earlier / "run.json").read_text(encoding="utf-8") == '{"status": "completed"}'
    assert a_file.read_text(encoding="utf-8") == "mine"
    assert not (tmp_path / "runs").exists(), "nothing was written for a refused start"
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh = TrainingConfig.from_data({**config, "output_dir": str(empty)})
    assert preflight_training(REGISTRY, fresh, probe(verify=False)).config.output_dir == empty


# -- real runs ---------------------------------------------------------------------


@pytest.mark.slow
def test_full_disk_fails_the_run_stops_the_trainer_and_frees_the_engine(
    config: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=tmp_path)
    engine.training.start({**config, "steps": 100_000})
    wait_for_step(engine)
    trainer = engine.training.current.pid  # noqa: SLF001 - the test checks the child is stopped

    def disk_full(path: Path, data: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(json_files, "write_json_atomic", disk_full)
    record = engine.training.wait(timeout=60)
    assert record.status == "failed" and record.error is not None
    assert record.error["code"] == "disk_full" and "disk is full" in record.error["message"]
    assert gone(trainer)
    status = engine.training.status()
    assert status is not None and status["status"] == "failed"
    assert engine.status()["job"] is None and engine.residency.owner is None
    assert not (tmp_path / LOCK_NAME).exists()
    monkeypatch.undo()  # space was freed
    [listed] = engine.training.runs()
    assert listed["status"] == "failed" and listed["error"]["code"] == "disk_full"  # type: ignore[index]
    assert json.loads(record.path.read_text(encoding="utf-8"))["status"] == "failed"
    assert engine.training.plan(config).config.steps == config["steps"]  # nothing holds the engine now


PARENT = """
import json, sys, time
from engine import Engine
from engine.hardware.probe import probe

runs, base, data = sys.argv[1:4]
engine = Engine(hardware=probe(verify=False), runs_dir=runs)
engine.training.start({"base_model": base, "dataset_dir": data, "resolution": 64, "steps": 100000,
                       "lora_rank": 2, "device": "cpu"})
deadline = time.monotonic() + 240
while (engine.training.status() or {}).get("step", 0) < 1:
    if time.monotonic() > deadline:
        sys.exit("the run never reached step 1")
    time.sleep(0.1)
status = engine.training.status()
print(json.dumps({"pid": status["pid"], "run_id": status["run_id"]}), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_killed_parent_takes_its_trainer_along_and_the_record_says_failed(
    config: dict[str, object], tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(runs), str(config["base_model"]), str(config["dataset_dir"])],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the parent engine exited early ({parent.wait()})"
        child = json.loads(line)
        # A second engine on the same runs folder: refused while that trainer lives.
        engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=runs)
        host = HostModel(engine)
        with pytest.raises(Busy) as raised:
            engine.training.start(config)
        assert raised.value.code == "run_in_progress"
        assert str(child["pid"]) in raised.value.message and child["run_id"] in raised.value.message
        assert host.evicted == 0 and engine.status()["job"] is None
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 2.0
        while not gone(child["pid"]):
            assert time.monotonic() < deadline, "the trainer outlived its parent by more than 2 s"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
    [run] = [r for r in engine.training.runs() if r["run_id"] == child["run_id"]]
    assert run["status"] == "failed" and run["error"]["code"] == "trainer_gone"  # type: ignore[index]
    assert_next_run_completes_and_its_end_frees_the_engine(engine, config, after=child["run_id"])
    assert host.evicted == 1


def assert_next_run_completes_and_its_end_frees_the_engine(
    engine: Engine, config: dict[str, object], *, after: str
) -> None:
    """Start a run (a stale lock is taken over) and watch its status to the end.

    It is started from a thread that ends once the trainer is up (armed its
    parent-death signal), as a server's request thread may: the trainer
    must not die with that thread. The moment the
    status says finished, the job, the GPU and the run lock are free, so a
    client that reads "completed" can start again at once.
    """
    started: list[dict[str, object]] = []

    def start_and_leave() -> None:
        started.append(engine.training.start(config))
        deadline = time.monotonic() + 120
        while (engine.training.status() or {}).get("phase") == "pending" and time.monotonic() < deadline:
            time.sleep(0.05)  # the child reports a phase once it watches its parent

    starter = threading.Thread(target=start_and_leave)
    starter.start()
    starter.join()
    assert started and started[0]["run_id"] != after
    deadline = time.monotonic() + 300
    while (status := engine.training.status() or {}).get("status") not in TERMINAL:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert status["status"] == "completed" and status["run_id"] == started[0]["run_id"], status.get("error")
    assert engine.status()["job"] is None and engine.residency.owner is None
    assert RunLock(engine.runs_dir).holder() is None
    assert engine.training.wait(timeout=60).status == "completed"


def test_full_disk_at_start_is_refused_before_eviction(
    config: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=tmp_path)
    host = HostModel(engine)

    def disk_full(path: Path, data: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(json_files, "write_json_atomic", disk_full)
    with pytest.raises(EngineError) as raised:
        engine.training.start(config)
    assert raised.value.code == "disk_full" and str(tmp_path) in raised.value.message
    assert host.evicted == 0 and engine.residency.owner is None and engine.status()["job"] is None
    assert RunLock(tmp_path).holder() is None


def test_a_trainer_that_cannot_read_its_plan_reports_trainer_start_failed() -> None:
    """The trainer child, started as the runner starts it, handed a plan its interpreter
    cannot unpickle (a class from a module it does not have, as after a half-done upgrade):
    it reports ``trainer_start_failed`` with the reason and exits 1, never a NameError."""
    import pickle
    import socket
    from multiprocessing.connection import Connection

    parent_end, child_end = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.training.child", str(child_end.fileno()), str(os.getpid())],
        pass_fds=(child_end.fileno(),), start_new_session=True, stderr=subprocess.PIPE, text=True,
    )
    child_end.close()
    conn = Connection(os.dup(parent_end.fileno()))
    parent_end.close()
    conn.send([p for p in sys.path if p])
    # A pickle naming a class of a module that does not exist in the child.
    conn.send_bytes(b"cno_such_module\nPlan\n.")  # pickle's GLOBAL opcode, then STOP
    event = conn.recv()
    assert event["type"] == "error" and event["code"] == "trainer_start_failed", event
    assert "could not read its plan" in event["message"] and "no_such_module" in event["message"]
    assert process.wait(timeout=60) == 1, process.stderr.read() if process.stderr else ""
    assert "NameError" not in (process.stderr.read() if process.stderr else "")
    conn.close()
    with pytest.raises(ModuleNotFoundError):  # what the bytes mean to any interpreter
        pickle.loads(b"cno_such_module\nPlan\n.")
