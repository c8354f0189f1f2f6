"""Runs people can trust for hours: Ctrl-C saves, embedding scripts need no guard,
checkpoints resume bit for bit, and a run's written config repeats it.

Real CLI processes and real trainer children on tiny pipelines (64 px, CPU),
real signals to a real process group.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.testing.datasets import write_dataset
from engine.training.records import RECORD_NAME, list_runs
from tests.support import TINY, losses, run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), count=2)


def wait_for_step(record: Path, process: subprocess.Popen[str], step: int) -> None:
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached its step"
        try:
            if json.loads(record.read_text(encoding="utf-8")).get("step", 0) >= step:
                return
        except (OSError, ValueError):
            pass  # not written yet, or being replaced
        time.sleep(0.1)


@pytest.mark.slow
def test_ctrl_c_stops_an_fp16_run_with_samples_after_the_step_and_saves_a_loadable_lora(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "runs" / "run"
    cli = subprocess.Popen(
        [sys.executable, "-m", "engine", "train", "--base", str(tiny_pipeline("sdxl")), "--data", str(dataset),
         *TINY, "--steps", "100000", "--output", str(out), "--runs-dir", str(tmp_path / "runs"), "--json",
         "--sample-prompt", "a red fox", "--sample-prompt", "a blue cube", "--sample-every", "2",
         "--sample-steps", "1", "--mixed-precision", "fp16"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_for_step(out / RECORD_NAME, cli, 4)
        os.killpg(cli.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
        stdout, stderr = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    assert cli.returncode == 130, stderr[-3000:]  # stopped by Ctrl-C: 130, as `generate` exits
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    record = json.loads(stdout)
    assert record["status"] == "stopped" and 4 <= record["step"] < 100000  # type: ignore[operator]
    # fp16 mixed precision trains under a GradScaler: its scale is reported every step; the loss stays finite.
    scales = record["metrics"]["loss_scale"]  # type: ignore[index]
    assert len(scales) == record["step"] and all(scale > 0 for _, scale in scales)
    assert all(math.isfinite(loss) for _, loss in losses(record))
    # Samples from the run's own pipeline at every second step, both prompts, fixed seeds.
    samples = record["samples"]
    assert [(s["step"], s["prompt"]) for s in samples] == [  # type: ignore[index]
        (step, prompt) for step in range(2, record["step"] + 1, 2) for prompt in ("a red fox", "a blue cube")
    ]
    assert all(Path(s["path"]).parent == out / "samples" and Path(s["path"]).is_file() for s in samples)
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline("sdxl")))
    pipe.load_lora_weights(record["outputs"]["lora"])  # type: ignore[index]
    assert pipe.get_list_adapters()
    assert_runs_show_and_rm(record, home=tmp_path)


@pytest.mark.slow
def test_ctrl_c_before_the_first_step_stops_at_once_and_the_phases_are_shown(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    """``train`` says what it does before its first step (loading the base, caching the dataset:
    minutes on a 14B base, and it printed nothing); a Ctrl-C then stops at once, nothing being
    trained (it waited for the load and the caching to end)."""
    data = write_dataset(tmp_path / "data", count=300)  # caching takes seconds, room to press Ctrl-C
    out = tmp_path / "runs" / "run"
    cli = subprocess.Popen(
        [sys.executable, "-m", "engine", "train", "--base", str(tiny_pipeline("sdxl")), "--data", str(data),
         *TINY, "--steps", "100000", "--output", str(out), "--runs-dir", str(tmp_path / "runs")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    seen: list[str] = []
    try:
        assert cli.stderr is not None
        for line in cli.stderr:
            seen.append(line)
            if line.startswith("training: encoding the dataset"):
                os.killpg(cli.pid, signal.SIGINT)
                break
        stdout, rest = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    stderr = "".join(seen) + rest
    assert cli.returncode == 130, stderr[-3000:]
    assert f"training: loading the base {tiny_pipeline('sdxl')}" in stderr
    assert "stopping now: no step is trained yet" in stderr and "Traceback" not in stderr
    record = json.loads((out / RECORD_NAME).read_text(encoding="utf-8"))
    assert record["status"] == "stopped" and record["step"] == 0


def assert_runs_show_and_rm(record: dict[str, object], home: Path) -> None:
    """``runs show`` lists config, metrics, samples and files; ``runs rm`` deletes the folder.

    The runs folder defaults to ``$DIFFUSION_ENGINE_HOME/runs``, not the current folder.
    """
    env = {"DIFFUSION_ENGINE_HOME": str(home)}
    shown = run_cli("runs", "show", str(record["run_id"]), env=env)
    assert shown.returncode == 0, shown.stderr
    for expected in ("stopped", "lora_rank", "loss_scale", "a red fox", "samples/step-00000002-0.png",
                     "pytorch_lora_weights.safetensors", "config.toml"):
        assert expected in shown.stdout, expected
    assert run_cli("runs", "rm", str(record["run_id"]), env=env).returncode == 0
    assert not Path(str(record["folder"])).exists()
    listed = run_cli("runs", env=env)
    assert f"no runs in {home / 'runs'}" in listed.stdout
    missing = run_cli("runs", "show", "nope", env=env)
    assert missing.returncode == 2 and "error[run_not_found]" in missing.stderr


def readme_embedding_snippet() -> str:
    """The first Python block of docs/embedding.md (the README links it as the embedding guide)."""
    text = (ROOT / "docs" / "embedding.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]


def run_script(folder: Path, source: str, base: Path, dataset: Path) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run ``source`` as ``app.py`` beside ``./zimage-turbo`` and ``./photos``; (result, evictions)."""
    folder.mkdir()
    (folder / "app.py").write_text(source, encoding="utf-8")
    (folder / "zimage-turbo").symlink_to(base)
    (folder / "photos").symlink_to(dataset)
    done = subprocess.run([sys.executable, "app.py"], cwd=folder, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done, done.stdout.count("evicting the chat model")


@pytest.mark.slow
def test_readme_embedding_snippet_runs_as_a_plain_script_without_a_main_guard(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    snippet = readme_embedding_snippet()
    assert "__main__" not in snippet
    base = tiny_pipeline("zimage")
    # Verbatim: on a machine without a GPU the family refuses device auto, before anything is evicted.
    done, evictions = run_script(tmp_path / "verbatim", snippet, base, dataset)
    if done.returncode != 0:
        assert "PreflightError" in done.stderr and evictions == 0, done.stderr[-3000:]
    else:
        assert evictions == 1 and done.stdout.strip().splitlines()[-1] == "stopped", done.stderr[-3000:]
    assert all(r.finished for r in list_runs(tmp_path / "verbatim" / "runs"))
    # The same script told to train on the CPU: the child starts without re-running it.
    on_cpu = snippet.replace('"steps": 1500}', '"steps": 1500, "device": "cpu"}')
    assert on_cpu != snippet
    on_cpu += 'print("phase:", engine.training.status()["phase"])\n'  # the phase ends in the terminal state
    done, evictions = run_script(tmp_path / "cpu", on_cpu, base, dataset)
    assert done.returncode == 0, done.stderr[-3000:]
    assert evictions == 1 and done.stdout.strip().splitlines()[-2:] == ["stopped", "phase: stopped"]
    [record] = list_runs(tmp_path / "cpu" / "runs")
    assert record.status == "stopped" and record.error is None


def test_cli_config_errors_name_flags_not_fields(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('base_model = "x"\ndataset_dir = "y"\nlora_rank = 0\n', encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "engine", "train", "--config", str(tmp_path / "run.toml")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "--rank:" in done.stderr and "lora_rank" not in done.stderr


@pytest.mark.slow
def test_http_cancel_lands_in_the_loading_phase_and_the_phase_ends_cancelled(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    import httpx

    from engine.hardware.probe import probe
    from engine.contract.plugins import load_registry
    from engine.server.app import ServerSettings, create_app
    from engine.service.facade import Engine
    from tests.support import LiveServer

    token = "t0ken"
    auth = {"Authorization": f"Bearer {token}"}
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=outputs)
    settings = ServerSettings(model_roots=(tiny_pipeline("sdxl").parent,), dataset_roots=(dataset.parent,),
                              output_roots=(outputs,), token=token)
    body = {"base_model": "sdxl", "dataset_dir": dataset.name, "resolution": 64, "steps": 100_000,
            "lora_rank": 2, "device": "cpu"}
    with LiveServer(create_app(engine, settings)) as url:
        started = httpx.post(f"{url}/v1/training/start", json=body, headers=auth, timeout=60)
        assert started.status_code == 200, started.text
        cancelled = httpx.post(f"{url}/v1/training/cancel", headers=auth, timeout=60)  # before any step
        assert cancelled.status_code == 200, cancelled.text
        record = engine.training.wait(timeout=240)
        status = httpx.get(f"{url}/v1/training/status", headers=auth).json()
        again = httpx.post(f"{url}/v1/training/cancel", headers=auth, timeout=60)
    assert record.status == "cancelled" and record.step == 0 and "lora" not in record.outputs
    assert status["status"] == status["phase"] == "cancelled"
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_training"


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # Long steps (120 micro-batches each), so the second Ctrl-C lands mid-step 0.3 s after the
    # first (30 took under 0.3 s on an idle 2-core machine: the step ended, and the run stopped
    # gracefully with that step's LoRA).
    (tmp_path / "slow.toml").write_text("grad_accumulation = 120\n", encoding="utf-8")
    cli = subprocess.Popen(
        [sys.executable, "-m", "engine", "train", "--config", str(tmp_path / "slow.toml"),
         "--base", str(tiny_pipeline("sdxl")), "--data", str(dataset),
         *TINY, "--steps", "100000", "--save-every", "1", "--keep-checkpoints", "2", "--output", str(out),
         "--runs-dir", str(tmp_path), "--json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_for_step(out / RECORD_NAME, cli, 2)
        os.killpg(cli.pid, signal.SIGINT)
        time.sleep(0.3)
        os.killpg(cli.pid, signal.SIGINT)  # impatient: stop now, mid-step
        stdout, stderr = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    assert cli.returncode == 130, stderr[-3000:]  # interrupted, as a shell reports it
    record = json.loads(stdout)
    assert record["status"] == "stopped" and record["error"] is None
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())  # no half-written one left behind
    assert len(kept) == 2 and all((out / "checkpoints" / k / "state.safetensors").is_file() for k in kept)
    last = out / "checkpoints" / kept[-1]
    assert record["outputs"]["checkpoint"] == str(last)  # type: ignore[index]
    # The partial step was not saved; the run still has a LoRA at its top level: the last checkpoint's.
    assert record["outputs"]["lora"] == str(out / "pytorch_lora_weights.safetensors")  # type: ignore[index]
    assert record["outputs"]["lora_from_checkpoint"] == str(last)  # type: ignore[index]
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == (last / "pytorch_lora_weights.safetensors").read_bytes()
    trainer = record["pid"]
    assert not Path(f"/proc/{trainer}").exists() or "Z" in Path(f"/proc/{trainer}/stat").read_text().split()[2]
