"""Multi-GPU training through accelerate, on CPU: 2 ranks over gloo, in the engine's trainer child.

One 2-rank run is stopped from the parent after a few steps (stop reaches
both ranks, rank 0 saves); its loss curve is compared with a 1-process run
with the same global batch, and its ranks' LoRA digests with each other.
A second 2-rank run loses rank 1 to SIGKILL as soon as the ranks are up
(rank 0's next collective breaks: the launcher must still name rank 1). The device-count
refusal runs on a GPU preset with a host model that must never be evicted.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine import Engine
from engine.errors import EngineError
from engine.hardware.devices import device_profiles
from engine.hardware.presets import preset
from engine.hardware.probe import probe
from engine.hardware.profile import DeviceFacts
from engine.contract.plugins import load_registry
from engine.testing.datasets import write_dataset
from engine.requests.training import TrainingConfig
from engine.training.preflight import TrainingPlan, preflight_training
from engine.training.records import RunRecord
from engine.training.runner import TrainingRun
from engine.training.trainer import run_training
from tests.support import HostModel

REGISTRY = load_registry()
FAMILY = "flux"


def make_plan(base: Path, data: Path, hardware: object = None, **overrides: object) -> TrainingPlan:
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": 64, "lora_rank": 4,
        "learning_rate": 1e-3, "lr_scheduler": "constant", "warmup_steps": 0, "device": "cpu",
        "prompt_cache": False, **overrides,
    })
    return preflight_training(REGISTRY, config, hardware or probe(verify=False))  # type: ignore[arg-type]


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(run: TrainingRun, ready: Callable[[RunRecord], bool], timeout: float = 300) -> RunRecord:
    deadline = time.monotonic() + timeout
    while not ready(record := run.poll()):
        assert not record.finished, record.error
        assert time.monotonic() < deadline, f"run still at step {record.step}"
        time.sleep(0.1)
    return record


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Three images in global batches of two: every other batch is short, so one rank has no example.
    return write_dataset(tmp_path_factory.mktemp("data"), count=3, size=72)


@pytest.fixture(scope="module")
def stopped(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunRecord, list[tuple[int, float]]]:
    """A 2-rank run (1 image per rank) stopped from the parent at step >= 2, and a
    1-process run with the same global batch (2) over as many steps: its loss curve."""
    base = tiny_pipeline(FAMILY)
    run = TrainingRun(make_plan(base, dataset, gpus=2, batch_size=1, steps=1000), tmp_path_factory.mktemp("runs"))
    run.start()
    wait_for(run, lambda r: r.step >= 2)
    run.stop(save=True)
    record = run.wait(timeout=300)
    events: list[dict[str, object]] = []
    run_training(make_plan(base, dataset, batch_size=2, steps=max(record.step, 1)),
                 tmp_path_factory.mktemp("solo"), events.append, lambda: None)
    return record, [(int(e["step"]), float(e["loss"])) for e in events if e["type"] == "progress"]  # type: ignore[arg-type]


@pytest.mark.slow
def test_stop_from_the_parent_stops_both_ranks_and_rank_0_saves(
    stopped: tuple[RunRecord, list[tuple[int, float]]],
) -> None:
    record, _ = stopped
    assert record.status == "stopped" and 2 <= record.step < 1000, record.error
    assert load_file(record.outputs["lora"])  # written by rank 0, once
    assert record.ranks is not None and record.ranks["world"] == 2
    pids = record.ranks["pids"]
    assert isinstance(pids, list) and len(set(pids)) == 2 and record.pid not in pids
    assert all(gone(pid) for pid in [*pids, record.pid])  # type: ignore[list-item]


@pytest.mark.slow
def test_both_ranks_hold_the_same_lora_and_match_a_one_process_run(
    stopped: tuple[RunRecord, list[tuple[int, float]]],
) -> None:
    record, solo = stopped
    assert record.ranks is not None
    digests = record.ranks["lora_sha256"]
    assert isinstance(digests, list) and len(digests) == 2 and digests[0] == digests[1]
    curve = record.metrics["loss"].points
    assert [s for s, _ in curve] == [s for s, _ in solo] == list(range(1, record.step + 1))
    assert max(abs(a - b) for (_, a), (_, b) in zip(curve, solo)) < 1e-4
    assert len({round(v, 3) for _, v in curve}) > 1  # the curve moves: it is not one repeated value


@pytest.mark.slow
def test_a_killed_rank_fails_the_run_naming_it_and_leaves_no_process(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    tracebacks = set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*"))  # torch's, one per failed rank
    run = TrainingRun(make_plan(tiny_pipeline(FAMILY), dataset, gpus=2, batch_size=1, steps=1000), tmp_path)
    run.start()
    record = wait_for(run, lambda r: r.ranks is not None)  # the ranks are up: rank 0 goes on loading
    pids = list(record.ranks["pids"])  # type: ignore[index, call-overload]
    os.kill(pids[1], signal.SIGKILL)  # rank 0's next collective breaks; the launcher names rank 1
    record = run.wait(timeout=120)
    assert record.status == "failed" and record.error is not None
    assert record.error["code"] == "rank_failed"
    assert "rank 1 of 2" in record.error["message"] and "signal 9" in record.error["message"]
    assert all(gone(pid) for pid in [*pids, record.pid])
    assert not (tmp_path / record.run_id / "pytorch_lora_weights.safetensors").exists()
    # Nothing of the ranks is left: not their error records, not torch's copy of rank 0's traceback.
    assert not list((tmp_path / record.run_id).glob(".ranks-*"))
    assert set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*")) <= tracebacks


def test_gpus_over_the_device_count_is_refused_before_any_eviction(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = str(Path(__file__).parent / "no-base-needed")  # refused before the base is read
    engine = Engine(registry=REGISTRY, hardware=preset("h100"), runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    with pytest.raises(EngineError) as raised:
        engine.training.start({"base_model": base, "dataset_dir": str(dataset), "gpus": 2})
    assert raised.value.code == "not_enough_gpus"
    assert "--gpus 2" in raised.value.message and "1 GPU (H100 80GB HBM3)" in raised.value.message
    assert host.evicted == 0 and engine.residency.owner is None and engine.training.status() is None
    # The terminal's dry run gives the same refusal, in its flags.
    from engine.cli import main

    assert main(["train", "--base", base, "--data", str(dataset), "--gpus", "2", "--hardware", "h100",
                 "--dry-run"]) == 2
    assert "error[not_enough_gpus]" in capsys.readouterr().err


def test_each_device_is_checked_and_cpu_ranks_need_no_gpu(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    four = preset("4xh100")
    assert [d.device_name for d in device_profiles(four)] == ["H100 80GB HBM3"] * 4
    small = DeviceFacts("Tesla T4", 15.8, 0.5, (7, 5))  # device 2: no native bf16, next to no memory
    box = four.replace(devices=(four.devices[0], four.devices[1], small, four.devices[3]))
    engine = Engine(registry=REGISTRY, hardware=box, runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    config = {"base_model": str(tiny_pipeline(FAMILY)), "dataset_dir": str(dataset), "resolution": 64}
    assert engine.training.plan({**config, "gpus": 2}).config.gpus == 2  # devices 0 and 1 are fine
    with pytest.raises(EngineError) as raised:
        engine.training.start({**config, "gpus": 3})
    assert raised.value.message.startswith("GPU 2 (Tesla T4)")
    assert host.evicted == 0 and engine.residency.owner is None
    sixteen_cores = probe(verify=False).replace(cpu_count=16)
    plan = make_plan(tiny_pipeline(FAMILY), dataset, sixteen_cores, gpus=8)  # device=cpu: 8 gloo processes, no GPU
    assert plan.device == "cpu" and plan.to_dict()["gpus"] == 8
    with pytest.raises(EngineError) as raised:  # one process per core at most: 64 on 16 would only thrash
        make_plan(tiny_pipeline(FAMILY), dataset, sixteen_cores, gpus=64)
    assert raised.value.code == "not_enough_cores" and "has 16 cores" in raised.value.message


# -- several machines: two nodes on loopback ---------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_nodes(base: Path, data: Path, root: Path, **config: object) -> list[TrainingRun]:
    """Node 0 and node 1 of one run, as two machines would start it: the same config, each
    preflighted on its own (the plan is the machine's), with its own node rank and runs folder."""
    address = f"127.0.0.1:{free_port()}"
    runs = []
    for rank in (0, 1):
        plan = make_plan(base, data, batch_size=1, nodes=2, node_rank=rank, main_address=address, **config)
        run = TrainingRun(plan, root / f"node{rank}")
        run.start()
        runs.append(run)
    return runs


@pytest.mark.slow
def test_two_nodes_over_gloo_hold_the_same_lora_and_match_a_one_process_run(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path,
) -> None:
    base = tiny_pipeline(FAMILY)
    main, other = (run.wait(timeout=300) for run in start_nodes(base, dataset, tmp_path, steps=3))
    assert main.status == other.status == "completed", (main.error, other.error)
    assert main.ranks is not None and main.ranks["world"] == 2 and main.ranks["nodes"] == 2
    digests = main.ranks["lora_sha256"]
    assert isinstance(digests, list) and len(digests) == 2 and digests[0] == digests[1]
    assert load_file(main.outputs["lora"]) and "lora" not in other.outputs  # node 0 writes the run
    events: list[dict[str, object]] = []
    run_training(make_plan(base, dataset, batch_size=2, steps=3), tmp_path / "solo", events.append, lambda: None)
    solo = [(int(e["step"]), float(e["loss"])) for e in events if e["type"] == "progress"]  # type: ignore[arg-type]
    for record in (main, other):  # node 1's engine follows the same run: the same curve
        curve = record.metrics["loss"].points
        assert [s for s, _ in curve] == [s for s, _ in solo] == [1, 2, 3]
        assert max(abs(a - b) for (_, a), (_, b) in zip(curve, solo)) < 1e-4


@pytest.mark.slow
def test_a_killed_node_fails_the_run_with_a_true_record_and_frees_every_rank(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path,
) -> None:
    runs = start_nodes(tiny_pipeline(FAMILY), dataset, tmp_path, steps=1000)
    records = [wait_for(run, lambda r: r.ranks is not None) for run in runs]
    pids = [int(pid) for record in records for pid in record.ranks["pids"]]  # type: ignore[index]
    assert_listening_on_loopback_only([*pids, *(int(r.pid) for r in records)])  # type: ignore[arg-type]
    os.kill(int(records[1].pid), signal.SIGKILL)  # type: ignore[arg-type]  # node 1's trainer; its rank dies with it
    record = runs[0].wait(timeout=120)
    assert record.status == "failed" and record.error is not None
    assert record.error["code"] == "node_lost" and "node 0 of 2" in record.error["message"], record.error
    lost = runs[1].wait(timeout=60)
    assert lost.status == "failed" and lost.error is not None and lost.error["code"] == "trainer_died"
    deadline = time.monotonic() + 30
    while not all(gone(pid) for pid in [*pids, int(records[0].pid)]):  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "a rank outlived its run"
        time.sleep(0.1)
    assert not (Path(record.folder) / "pytorch_lora_weights.safetensors").exists()


def assert_listening_on_loopback_only(pids: list[int]) -> None:
    """Every socket these processes (and their children) listen on is bound to loopback: a
    run meeting at 127.0.0.1 is not reachable from the network (its store, gloo's pairs)."""
    import ipaddress

    import psutil

    processes = [psutil.Process(pid) for pid in pids]
    processes += [child for process in processes for child in process.children(recursive=True)]
    listening = [(process.pid, c.laddr) for process in set(processes)
                 for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening, "the run listens nowhere: the check would prove nothing"
    assert all(ipaddress.ip_address(address.ip).is_loopback for _, address in listening), listening


@pytest.mark.slow
def test_a_node_whose_peers_never_come_fails_with_nodes_not_joined(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path,
) -> None:
    """Node 0 alone, and node 1 alone: each waits its --join-timeout, then fails with a true record."""
    address = f"127.0.0.1:{free_port()}"
    for rank in (0, 1):
        plan = make_plan(tiny_pipeline(FAMILY), dataset, batch_size=1, nodes=2, node_rank=rank, main_address=address,
                         join_timeout=3, steps=2)
        run = TrainingRun(plan, tmp_path / f"alone{rank}")
        run.start()
        record = run.wait(timeout=120)
        assert record.status == "failed" and record.error is not None, record.to_dict()
        assert record.error["code"] == "nodes_not_joined", record.error
        assert address in record.error["message"] and "--join-timeout" in record.error["message"]
        assert RunRecord.load(Path(record.folder) / "run.json").status == "failed"  # on disk too, not pending


@pytest.mark.slow
def test_ctrl_c_while_the_nodes_have_not_joined_stops_the_run_at_once(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path,
) -> None:
    """The real CLI on node 0 with no node 1: Ctrl-C is honoured in the rendezvous (it was ignored),
    the command ends 130 and the record says stopped."""
    import subprocess
    import sys

    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "engine", "train", "--base", str(tiny_pipeline(FAMILY)), "--data", str(dataset),
               "--device", "cpu", "--resolution", "64", "--steps", "2", "--nodes", "2", "--node-rank", "0",
               "--main-address", f"127.0.0.1:{free_port()}", "--runs-dir", str(runs), "--no-prompt-cache"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (records := list(runs.glob("*/run.json"))) or RunRecord.load(records[0]).pid is None:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.2)
        time.sleep(3)  # into the rendezvous
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, (out, err)
    record = RunRecord.load(records[0])
    assert record.status == "stopped" and record.step == 0, record.to_dict()
    assert "Traceback" not in err


def test_a_node_config_that_cannot_meet_is_refused_before_any_eviction(dataset: Path, tmp_path: Path) -> None:
    """The 0-eviction rows of the nodes fields: no rendezvous address, a rank past the nodes."""
    engine = Engine(registry=REGISTRY, hardware=preset("h100"), runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    base = {"base_model": str(Path(__file__).parent / "no-base-needed"), "dataset_dir": str(dataset)}
    for extra, words in (({"nodes": 2}, "main_address HOST:PORT"),
                         ({"nodes": 2, "node_rank": 2, "main_address": "h:1"}, "is not below nodes 2"),
                         ({"nodes": 2, "main_address": "127.0.0.1:99999"}, "not a TCP port"),
                         ({"nodes": 2, "main_address": "127.0.0.1:0"}, "not a TCP port"),
                         ({"node_rank": 1}, "only with nodes > 1"),
                         ({"nodes": 2, "main_address": "h:1", "join_timeout": 0}, "join_timeout")):
        with pytest.raises(EngineError) as raised:
            engine.training.start({**base, **extra})
        assert raised.value.code == "invalid_config" and words in raised.value.message, raised.value.message
    assert host.evicted == 0 and engine.residency.owner is None and engine.training.status() is None
