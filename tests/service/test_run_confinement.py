"""A run is where its record was found: a copied or planted ``run.json`` whose ``folder``
names another place sends no delete, no file read, no listing and no resume there.

Tried as a hostile run folder would, on every face: Python, the CLI (in-process) and a
real server on loopback. The victims (another run, a folder outside the roots, the runs
root itself) must come out byte for byte as they went in.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from engine.testing.datasets import write_dataset
from engine.requests.training import TrainingConfig
from engine.training.records import MAX_RUN_FILES, RECORD_NAME, RunRecord, list_runs, run_files
from engine.training.state_file import write_state
from tests.support import HostModel, LiveServer
from tests.support import real_state

TOKEN = "confined"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def plant(runs: Path, name: str, folder: Path, config: dict[str, object] | None = None) -> Path:
    """A finished run ``runs/name`` whose record claims to live at ``folder``."""
    real = runs / name
    RunRecord(run_id=name, folder=real, family="sdxl", base_model="x", config=config or {}, plan={},
              status="completed", step=1, steps=1).save()
    data = json.loads((real / RECORD_NAME).read_text(encoding="utf-8"))
    (real / RECORD_NAME).write_text(json.dumps({**data, "folder": str(folder)}), encoding="utf-8")
    return real


class Disk:
    def __init__(self, base: Path) -> None:
        self.runs, self.outside = base / "runs", base / "outside"
        self.outside.mkdir(parents=True)
        (self.outside / "passwd").write_text("root:x:0:0\n", encoding="utf-8")
        self.victim = self.runs / "victim"
        RunRecord(run_id="victim", folder=self.victim, family="sdxl", base_model="x", config={}, plan={},
                  status="completed", step=3, steps=3).save()
        (self.victim / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
        self.elsewhere = plant(self.runs, "elsewhere", self.outside)
        self.rooted = plant(self.runs, "rooted", self.runs)
        self.slash = plant(self.runs, "slash", Path("/"))
        self.at_victim = plant(self.runs, "at-victim", self.victim)
        self.before = {"outside": snapshot(self.outside), "victim": snapshot(self.victim)}

    def untouched(self) -> None:
        assert snapshot(self.outside) == self.before["outside"]
        assert snapshot(self.victim) == self.before["victim"]


@pytest.fixture
def disk(tmp_path: Path) -> Disk:
    return Disk(tmp_path)


def test_a_loaded_record_is_where_it_was_found(disk: Disk) -> None:
    for folder in (disk.elsewhere, disk.rooted, disk.slash, disk.at_victim):
        assert RunRecord.load(folder / RECORD_NAME).folder == folder
    assert {r.run_id: r.folder for r in list_runs(disk.runs)}["elsewhere"] == disk.elsewhere


@pytest.mark.parametrize("name", ["elsewhere", "rooted", "slash", "at-victim"])
def test_python_and_the_cli_delete_only_the_planted_folder(disk: Disk, name: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=disk.runs)
    assert engine.training.remove(name)["folder"] == str(disk.runs / name)
    assert not (disk.runs / name).exists()
    disk.untouched()
    assert (disk.runs / "victim").is_dir() and disk.runs.is_dir()
    # The CLI, on a fresh copy of the planted run.
    plant(disk.runs, name, {"elsewhere": disk.outside, "rooted": disk.runs, "slash": Path("/"),
                            "at-victim": disk.victim}[name])
    assert main(["runs", "rm", name, "--runs-dir", str(disk.runs)]) == 0
    assert f"({disk.runs / name})" in capsys.readouterr().out
    assert not (disk.runs / name).exists()
    disk.untouched()


def test_a_symlinked_run_folder_that_leads_out_is_no_run(disk: Disk) -> None:
    (disk.runs / "link").symlink_to(disk.victim)
    (disk.runs / "out").symlink_to(disk.outside)
    RunRecord(run_id="out", folder=disk.outside, family="sdxl", base_model="x", config={}, plan={},
              status="completed").save()
    disk.before["outside"] = snapshot(disk.outside)
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=disk.runs)
    assert "out" not in {r["run_id"] for r in engine.training.runs()}
    with pytest.raises(EngineError) as refused:
        engine.training.remove("out")
    assert refused.value.code == "run_not_found"
    disk.untouched()


@pytest.fixture
def served(disk: Disk) -> Iterator[tuple[str, Disk]]:
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=disk.runs)
    settings = ServerSettings(output_roots=(disk.runs,), token=TOKEN)
    with LiveServer(create_app(engine, settings)) as url:
        yield url, disk


def test_http_files_of_a_planted_run_are_its_own(served: tuple[str, Disk]) -> None:
    url, disk = served
    for name in ("elsewhere", "slash", "at-victim"):
        listed = httpx.get(f"{url}/v1/training/runs/{name}/files", headers=AUTH)
        assert listed.status_code == 200 and [f["path"] for f in listed.json()] == [RECORD_NAME], listed.text
        record = httpx.get(f"{url}/v1/training/runs/{name}", headers=AUTH).json()
        assert record["folder"] == str(disk.runs / name) and record["files"] == [RECORD_NAME]
    for name, file in (("elsewhere", "passwd"), ("slash", "etc/passwd"), ("at-victim", "pytorch_lora_weights.safetensors")):
        response = httpx.get(f"{url}/v1/training/runs/{name}/files/{file}", headers=AUTH)
        assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_run_file", response.text
    disk.untouched()


def test_http_delete_of_a_planted_run_removes_it_alone(served: tuple[str, Disk]) -> None:
    url, disk = served
    for name in ("elsewhere", "rooted", "slash", "at-victim"):
        response = httpx.delete(f"{url}/v1/training/runs/{name}", headers=AUTH)
        assert response.status_code == 200 and response.json()["folder"] == str(disk.runs / name), response.text
        assert not (disk.runs / name).exists()
    disk.untouched()
    assert [r["run_id"] for r in httpx.get(f"{url}/v1/training/runs", headers=AUTH).json()] == ["victim"]


def test_a_listing_stops_before_it_walks_a_huge_folder(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    for index in range(MAX_RUN_FILES + 40):
        sub = folder / f"d{index // 100}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{index:04}").write_bytes(b"x")
    (folder / "escape").symlink_to(tmp_path)
    listed = run_files(folder)
    assert len(listed) == MAX_RUN_FILES and all(not name.startswith("escape") for name in listed)


# -- resume: the run continues in its own folder, never the one its record names --------------------


@pytest.fixture
def resumable(disk: Disk, tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> tuple[Disk, TrainingConfig]:
    """``at-victim``: a finished run with a real checkpoint whose record names the victim's folder."""
    data = write_dataset(tmp_path / "data", count=2)
    config = TrainingConfig(base_model=str(tiny_pipeline("sdxl")), dataset_dir=data, resolution=64, lora_rank=2,
                            device="cpu", steps=1, save_every=1)
    shutil.rmtree(disk.at_victim)
    plant(disk.runs, "at-victim", disk.victim, config.public_dict())
    checkpoint = disk.at_victim / "checkpoints" / "step-00000001"
    checkpoint.mkdir(parents=True)
    write_state(checkpoint, real_state())
    return disk, config


def wait_finished(engine: Engine) -> None:
    deadline = time.monotonic() + 120
    while (status := engine.training.status()) is not None and status.get("status") not in (
            "completed", "failed", "stopped", "cancelled"):
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def test_python_and_http_resumes_write_into_the_found_folder(resumable: tuple[Disk, TrainingConfig]) -> None:
    disk, config = resumable
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=disk.runs)
    HostModel(engine, name="host.llm", size_gb=0.0)
    point = engine.training.resume_point("at-victim")
    assert point["folder"] == str(disk.at_victim) and str(disk.at_victim) in str(point["checkpoint"])
    settings = ServerSettings(model_roots=(Path(config.base_model).parent,),
                              dataset_roots=(Path(config.dataset_dir).parent,), output_roots=(disk.runs,), token=TOKEN)
    body = {"base_model": config.base_model, "dataset_dir": str(config.dataset_dir), "resolution": 64,
            "lora_rank": 2, "device": "cpu", "steps": 2, "save_every": 1, "resume": "at-victim"}
    with LiveServer(create_app(engine, settings)) as url:
        started = httpx.post(f"{url}/v1/training/start", json=body, headers=AUTH, timeout=120)
        assert started.status_code in (200, 202), started.text
        assert started.json()["folder"] == str(disk.at_victim)
        wait_finished(engine)
    record = json.loads((disk.at_victim / RECORD_NAME).read_text(encoding="utf-8"))
    assert record["folder"] == str(disk.at_victim) and record["segments"], record
    disk.untouched()


def test_the_cli_resume_writes_into_the_found_folder(resumable: tuple[Disk, TrainingConfig],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    disk, _ = resumable
    main(["train", "--resume", "at-victim", "--runs-dir", str(disk.runs), "--steps", "2", "--json"])
    out = capsys.readouterr().out
    record = json.loads((disk.at_victim / RECORD_NAME).read_text(encoding="utf-8"))
    assert record["folder"] == str(disk.at_victim) and record["segments"], out[-2000:]
    disk.untouched()
