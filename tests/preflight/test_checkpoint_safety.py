"""Nothing from disk executes: a checkpoint's state is safetensors + JSON, a planted
pickle is refused on every route that resumes (CLI ``--resume``, a config file's
``resume_from``, HTTP ``resume``, Python), and a resume that changes what the
checkpoint holds is refused before anything starts, the run's records untouched."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from engine.testing.datasets import write_dataset
from engine.training.checkpoints import check_checkpoint, load_checkpoint
from engine.requests.training import TrainingConfig
from engine.training.records import RECORD_NAME, RunRecord
from engine.training.state_file import read_state, write_state
from tests.support import HostModel, LiveServer, Planted, real_state

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t0ken"


def test_the_state_round_trips_without_a_pickle(tmp_path: Path) -> None:
    state = real_state()
    write_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.safetensors"]
    assert b"\x80" not in (tmp_path / "state.json").read_bytes()  # JSON text, no pickle opcodes
    back = read_state(tmp_path)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 3))], lr=1e-3)
    optimizer.load_state_dict(back["optimizer"])  # keys come back as ints, betas as a tuple
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])  # type: ignore[index]
    assert back["scheduler"] == state["scheduler"]
    assert torch.equal(back["generator"], state["generator"]) and torch.equal(back["torch_rng"], state["torch_rng"])  # type: ignore[arg-type]
    assert back["order"] == [[1, 0], [2]] and back["step"] == 7 and back["ema"]["decay"] == 0.5


def test_tampered_states_are_refused_by_name(tmp_path: Path) -> None:
    def checkpoint(name: str) -> Path:
        folder = tmp_path / name / "checkpoints" / "step-00000001"
        folder.mkdir(parents=True)
        write_state(folder, real_state())
        return folder

    dangling = checkpoint("dangling")
    data = json.loads((dangling / "state.json").read_text())
    data["state"]["trainable"]["extra"] = {"$tensor": "t999"}
    (dangling / "state.json").write_text(json.dumps(data))
    truncated = checkpoint("truncated")
    (truncated / "state.safetensors").write_bytes((truncated / "state.safetensors").read_bytes()[:-5])
    nested = checkpoint("nested")
    (nested / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    missing = checkpoint("missing")
    (missing / "state.json").write_text(json.dumps({"format": 1, "state": {"step": 1}}))
    for folder, words in ((dangling, "t999"), (truncated, "truncated"), (nested, "state.json"), (missing, "lacks")):
        with pytest.raises(EngineError) as refused:
            check_checkpoint(folder)
        assert refused.value.code == "checkpoint_unreadable" and words in refused.value.message
    with pytest.raises(EngineError, match="not a checkpoint folder"):
        check_checkpoint(tmp_path / "dangling")


def _deep(levels: int) -> object:
    value: object = 0
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(("change", "words"), [
    (lambda st: st.update(order=_deep(600)), "deeper"),
    (lambda st: st.update(step="abc"), "step"),
    (lambda st: st.update(step=-5), "step"),
    (lambda st: st.update(step=10**30), "step"),
    (lambda st: st.update(step=True), "step"),
    (lambda st: st["optimizer"].update(state={"$items": [[0]]}), "$items"),
    (lambda st: st["optimizer"].update(state={"$items": [[[1, 2], {}]]}), "$items"),
    (lambda st: st.update(order=[["a"]]), "batch order"),
    (lambda st: st.update(trainable={"block.lora_A.weight": 3}), "not a tensor"),
])
def test_tampered_state_contents_are_refused_torch_free(tmp_path: Path, change: Callable[[dict], None],
                                                         words: str) -> None:
    """The contents a trainer would crash on, refused by the header-only check that runs
    before anything is evicted (a 600-deep nesting, a step that is no int in range, a bad
    ``$items``, a trainable weight that is no tensor)."""
    folder = tmp_path / "run" / "checkpoints" / "step-00000001"
    folder.mkdir(parents=True)
    write_state(folder, real_state())
    data = json.loads((folder / "state.json").read_text())
    change(data["state"])
    (folder / "state.json").write_text(json.dumps(data))
    with pytest.raises(EngineError) as refused:
        check_checkpoint(folder)
    assert refused.value.code == "checkpoint_unreadable" and words in refused.value.message, refused.value.message


def test_a_state_of_another_rank_or_moment_shape_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoints" / "step-00000001"
    folder.mkdir(parents=True)
    write_state(folder, real_state())  # rank 2
    check_checkpoint(folder, rank=2)
    with pytest.raises(EngineError, match="rank 8"):
        check_checkpoint(folder, rank=8)
    state = real_state()
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(5, 5)  # type: ignore[index]
    write_state(folder, state)
    with pytest.raises(EngineError, match="exp_avg has shape"):
        check_checkpoint(folder)


def test_an_http_resume_of_a_tampered_state_evicts_nothing(finished: dict[str, Path]) -> None:
    data = json.loads((finished["checkpoint"] / "state.json").read_text())
    data["state"]["step"] = "abc"
    (finished["checkpoint"] / "state.json").write_text(json.dumps(data))
    before = finished["record"].read_bytes()
    _, host, (response,) = serve_starts(finished, {"resume": "planted"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "checkpoint_unreadable", response.text
    assert host.evicted == 0
    assert_refused_untouched(finished, before)


# -- a planted pickle, on every route -------------------------------------------------------------


@pytest.fixture
def planted(tmp_path: Path, tiny_pipeline: Callable[[str], Path]) -> dict[str, Path]:
    """A finished run whose checkpoint's ``state.pt`` runs a command when unpickled."""
    runs, marker = tmp_path / "runs", tmp_path / "pwned"
    data = write_dataset(tmp_path / "data", count=2)
    folder = runs / "planted"
    checkpoint = folder / "checkpoints" / "step-00000001"
    checkpoint.mkdir(parents=True)
    torch.save({**real_state(), "trainable": {"x": Planted(marker)}}, checkpoint / "state.pt")
    config = TrainingConfig(base_model=str(tiny_pipeline("sdxl")), dataset_dir=data, resolution=64, lora_rank=2,
                            device="cpu", steps=1, save_every=1)
    RunRecord(run_id="planted", folder=folder, family="sdxl", base_model=config.base_model,
              config=config.public_dict(), plan={}, status="completed", step=1, steps=1).save()
    return {"runs": runs, "marker": marker, "checkpoint": checkpoint, "record": folder / RECORD_NAME,
            "base": Path(config.base_model), "data": data}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def assert_refused_untouched(planted: dict[str, Path], before: bytes) -> None:
    assert not planted["marker"].exists(), "the planted pickle ran"
    assert planted["record"].read_bytes() == before
    assert not (planted["record"].parent / "config.toml").exists()


@pytest.mark.slow
def test_cli_resume_refuses_a_planted_pickle(planted: dict[str, Path], tmp_path: Path) -> None:
    before = planted["record"].read_bytes()
    done = cli("train", "--resume", "planted", "--runs-dir", str(planted["runs"]), "--steps", "2", cwd=tmp_path)
    assert done.returncode == 2 and "error[checkpoint_unreadable]" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "state.pt" in done.stderr
    assert_refused_untouched(planted, before)


@pytest.mark.slow
def test_a_config_files_resume_from_refuses_a_planted_pickle(planted: dict[str, Path], tmp_path: Path) -> None:
    before = planted["record"].read_bytes()
    config = tmp_path / "resume.toml"
    config.write_text(
        f'base_model = "{planted["base"]}"\ndataset_dir = "{planted["data"]}"\nresolution = 64\nlora_rank = 2\n'
        f'device = "cpu"\nsteps = 2\nresume_from = "{planted["checkpoint"]}"\n', encoding="utf-8")
    for extra in ((), ("--dry-run",)):
        done = cli("train", "--config", str(config), "--runs-dir", str(planted["runs"]), *extra, cwd=tmp_path)
        assert done.returncode == 2 and "error[checkpoint_unreadable]" in done.stderr, done.stderr[-2000:]
    assert_refused_untouched(planted, before)


def serve_starts(planted: dict[str, Path], *bodies: dict[str, object]) -> tuple[Engine, HostModel, list[httpx.Response]]:
    """``bodies`` POSTed to ``training/start`` of a real server whose outputs root is the runs folder."""
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=planted["runs"])
    host = HostModel(engine, name="host.llm", size_gb=0.0)
    settings = ServerSettings(model_roots=(planted["base"].parent,), dataset_roots=(planted["data"].parent,),
                              output_roots=(planted["runs"],), token=TOKEN)
    base = {"base_model": str(planted["base"]), "dataset_dir": str(planted["data"]), "resolution": 64,
            "lora_rank": 2, "device": "cpu", "steps": 2}
    with LiveServer(create_app(engine, settings)) as url:
        responses = [httpx.post(f"{url}/v1/training/start", json={**base, **body}, timeout=60,
                                headers={"Authorization": f"Bearer {TOKEN}"}) for body in bodies]
    return engine, host, responses


def test_http_and_python_resumes_refuse_a_planted_pickle_before_eviction(planted: dict[str, Path]) -> None:
    before = planted["record"].read_bytes()
    engine, host, (by_id, by_path) = serve_starts(
        planted, {"resume": "planted"}, {"resume_from": str(planted["checkpoint"])})
    body = {"base_model": str(planted["base"]), "dataset_dir": str(planted["data"]), "resolution": 64,
            "lora_rank": 2, "device": "cpu", "steps": 2}
    for response in (by_id, by_path):
        assert response.status_code == 400 and response.json()["error"]["code"] == "checkpoint_unreadable", response.text
    with pytest.raises(EngineError) as refused:
        engine.training.start(body, resume="planted")
    assert refused.value.code == "checkpoint_unreadable"
    assert host.evicted == 0 and engine.training.status() is None
    assert_refused_untouched(planted, before)


# -- a resume is a request like any other ---------------------------------------------------------


@pytest.fixture
def finished(planted: dict[str, Path]) -> dict[str, Path]:
    """The planted run with a checkpoint in the engine's own format instead."""
    (planted["checkpoint"] / "state.pt").unlink()
    write_state(planted["checkpoint"], real_state())
    return planted


@pytest.mark.parametrize(("flags", "field"), [
    (("--rank", "8"), "rank"), (("--resolution", "128"), "resolution"), (("--family", "flux"), "family"),
    (("--base-precision", "bf16"), "base-precision"),
])
def test_a_resume_that_changes_what_the_checkpoint_holds_is_refused_naming_it(
    finished: dict[str, Path], tmp_path: Path, flags: tuple[str, ...], field: str
) -> None:
    before = finished["record"].read_bytes()
    done = cli("train", "--resume", "planted", "--runs-dir", str(finished["runs"]), *flags, cwd=tmp_path)
    assert done.returncode == 2 and "error[resume_mismatch]" in done.stderr, done.stderr[-2000:]
    assert field in done.stderr.split("resume_mismatch]")[1].split("(")[0]
    assert_refused_untouched(finished, before)


def test_an_http_resume_with_another_rank_is_refused_before_eviction(finished: dict[str, Path]) -> None:
    before = finished["record"].read_bytes()
    _, host, (response,) = serve_starts(finished, {"lora_rank": 4, "resume": "planted"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "resume_mismatch"
    assert "lora_rank" in response.json()["error"]["message"]
    assert host.evicted == 0
    assert_refused_untouched(finished, before)


def test_the_checkpoint_state_reads_back_through_load_checkpoint(finished: dict[str, Path]) -> None:
    assert load_checkpoint(finished["checkpoint"])["step"] == 7


# -- nothing in the tree deserialises code ----------------------------------------------------------


UNSAFE = re.compile(
    r"torch\.load\((?![^)]*weights_only=True)|pickle\.loads?\(|\bcPickle\b|(?<![.\w])eval\(|(?<![.\w])exec\(|yaml\.load\(|"
    r"yaml\.unsafe_load|marshal\.loads?\(|shelve\.open|dill\.|joblib\.load|numpy\.load\([^)]*allow_pickle=True|"
    r"np\.load\([^)]*allow_pickle=True|Unpickler\(|"
    # Library calls that unpickle what they are handed: torch's compile caches, packages, TorchScript.
    r"load_cache_artifacts\(|populate_caches\(|PackageImporter\(|torch\.jit\.load\(|torch\.package\.|"
    r"_write_to_local_cache\(|weights_only=False"
)
#: The few calls that must unpickle, each behind its check (the test below proves the check).
CHECKED = {
    # Only artifacts authenticated by the user's key, every name checked (checked_artifacts):
    # tests/runtime/test_compile_cache.py plants files and crafted names.
    ("engine/runtime/compile_cache.py", "info = CacheArtifactManager.populate_caches(artifacts)"),
}


def test_no_code_in_the_tree_deserialises_anything_that_can_execute() -> None:
    """Every ``torch.load`` passes ``weights_only=True``; no pickle, eval, exec or ``yaml.load``
    anywhere; a library call that unpickles runs only behind its check (:data:`CHECKED`)."""
    found = []
    for top in ("engine", "families", "examples", "bench"):
        for path in (ROOT / top).rglob("*.py"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#", 1)[0]
                if UNSAFE.search(code) and (path.relative_to(ROOT).as_posix(), code.strip()) not in CHECKED:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []


def test_the_compile_cache_checks_before_torch_unpickles() -> None:
    """The one populate call reads only what ``checked_artifacts`` returned, after the HMAC compare."""
    source = (ROOT / "engine/runtime/compile_cache.py").read_text(encoding="utf-8")
    restore = source[source.index("    def restore(self)"):source.index("    def store(self")]
    assert restore.index("hmac.compare_digest") < restore.index("checked_artifacts(data)") < restore.index(
        "populate_caches(artifacts)")
    assert "load_cache_artifacts(" not in source.split('"""', 2)[2]
