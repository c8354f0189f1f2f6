"""One runs folder: what a terminal trains, a resume typed anywhere, `runs` and the server see.

Kept apart from tests/training/test_training_runs.py so the two long files run on different workers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.testing.datasets import write_dataset

TINY = ("--resolution", "64", "--rank", "2", "--device", "cpu")


@pytest.mark.slow
def test_one_runs_folder_a_run_resumes_from_another_folder_and_every_face_sees_it(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run trained with relative paths in one folder records them absolute; resumed from
    another folder it continues; `runs`, `serve`'s default outputs and its LoRA
    roots (the web page's lists) all see it, in the one per-user runs folder. The CLI runs
    in-process (its trainer is a real child process)."""
    import shutil

    import httpx

    from engine import Engine
    from engine.cli import main
    from engine.cli.machine import serve_settings
    from engine.cli.parser import build_parser
    from engine.server.app import create_app
    from tests.support import LiveServer

    first_folder, other_folder, home = tmp_path / "here", tmp_path / "elsewhere", tmp_path / "home"
    other_folder.mkdir()
    shutil.copytree(tiny_pipeline("sdxl"), first_folder / "tiny")
    write_dataset(first_folder / "data", count=2)
    monkeypatch.setenv("DIFFUSION_ENGINE_HOME", str(home))

    def cli(*args: str, cwd: Path) -> object:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        status = main([*args, "--json"])
        out, err = capsys.readouterr()
        assert status == 0, err[-3000:]
        return json.loads(out)

    record = cli("train", "--base", "./tiny", "--data", "./data", *TINY, "--steps", "1", "--save-every", "1",
                 cwd=first_folder)
    assert isinstance(record, dict)
    assert Path(record["folder"]).parent == home / "runs"
    assert record["config"]["base_model"] == str(first_folder / "tiny")
    assert record["config"]["dataset_dir"] == str(first_folder / "data")

    # Resumed from another folder: the recorded base, dataset and checkpoint are found again
    # and the run continues to its new step count.
    # (In words this time: a run that reached its last step says so on its last line.)
    monkeypatch.chdir(other_folder)
    capsys.readouterr()
    assert main(["train", "--resume", record["run_id"], "--steps", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("Training complete: 2 steps; the LoRA is ") and last.endswith(".safetensors"), last
    listed = cli("runs", cwd=other_folder)
    resumed = next(r for r in listed if r["run_id"] == record["run_id"])  # type: ignore[union-attr]
    assert resumed["status"] == "completed" and resumed["step"] == 2
    assert [r["run_id"] for r in listed] == [record["run_id"]]  # type: ignore[attr-defined]

    # `serve` with no --outputs: the same folder, listed as runs and as LoRAs.
    settings = serve_settings(build_parser().parse_args(["serve"]))
    assert settings.output_roots == (home / "runs",)
    engine = Engine(runs_dir=settings.output_roots[0])
    with LiveServer(create_app(engine, settings)) as url:
        runs = httpx.get(f"{url}/v1/training/runs", timeout=30).json()
        one = httpx.get(f"{url}/v1/training/runs/{record['run_id']}", timeout=30).json()
        loras = httpx.get(f"{url}/v1/roots", timeout=30).json()["loras"]
    assert [r["run_id"] for r in runs] == [record["run_id"]]
    assert one["step"] == 2 and "pytorch_lora_weights.safetensors" in one["files"]
    assert [lo["run"] for lo in loras] == [record["run_id"]]
    assert loras[0]["path"].endswith("pytorch_lora_weights.safetensors")
