"""The plan and generate commands, run as a user runs them (a child process)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from tests.support import run_cli


def test_plan_family_on_a_preset_prints_every_control_with_its_reason() -> None:
    result = run_cli("plan", "--family", "flux", "--hardware", "rtx4090")
    assert result.returncode == 0, result.stderr
    for control in ("dtype", "transformer_quant", "memory_mode", "step_cache", "fp16_accumulation"):
        assert control in result.stdout
    assert "int8" in result.stdout and "Auto:" in result.stdout and "fallback" in result.stdout


def test_plan_json_for_a_checkpoint_and_explicit_choices() -> None:
    result = run_cli(
        "plan", "--family", "flux", "--checkpoint", "flux.1-schnell", "--hardware", "h100",
        "--quant", "fp8", "--json",
    )
    plan = json.loads(result.stdout)["plan"]
    assert plan["checkpoint"] == "flux.1-schnell"
    assert plan["resolved"]["transformer_quant"] == {
        "value": "fp8", "source": "explicit", "reason": "requested", "requested": "fp8", "status": "engaged",
        "overridden": False,
    }
    assert plan["resolved"]["step_cache"]["value"] == "off"  # 4-step schedule


def test_plan_for_a_local_model_shows_table_and_measured_sizes(tiny_pipeline: Callable[[str], Path]) -> None:
    result = run_cli("plan", "--model", str(tiny_pipeline("sdxl")), "--hardware", "t4", "--json")
    assert result.returncode == 0, result.stderr
    sizes = json.loads(result.stdout)["plan"]["sizes"]
    assert sizes["table"]["transformer_gb"] == 5.1
    assert 0 < sizes["measured"]["transformer_gb"] < 0.1
    text = run_cli("plan", "--model", str(tiny_pipeline("sdxl")), "--hardware", "t4").stdout
    assert "sizes (table)" in text and "sizes (measured)" in text


def test_plan_refuses_a_doomed_request_with_exit_2(tmp_path: Path) -> None:
    doomed = run_cli("plan", "--family", "qwen-image", "--hardware", "t4")
    assert doomed.returncode == 2 and "error[no_safe_dtype]" in doomed.stderr
    not_pipeline = run_cli("plan", "--model", str(tmp_path))
    assert not_pipeline.returncode == 2 and "error[not_a_pipeline]" in not_pipeline.stderr
    assert str(tmp_path) in not_pipeline.stderr and "Traceback" not in not_pipeline.stderr


@pytest.mark.slow
def test_generate_tiny_writes_pngs_of_the_asked_size(tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    result = run_cli(
        "generate", "--tiny", "zimage", "--prompt", "a fox", "-o", str(out), "--width", "64",
        "--height", "80", "--steps", "2", "--count", "2", "--json",
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    paths = [Path(p) for p in payload["images"]]
    assert [p.name for p in paths] == ["fox-0.png", "fox-1.png"]
    assert all(Image.open(p).size == (64, 80) for p in paths)
    from engine.hardware.probe import probe

    native = probe(verify=False).cpu_bf16_matmul  # the default computes bf16 where the CPU multiplies it
    assert payload["status"]["plan"]["resolved"]["dtype"]["value"] == ("bf16" if native else "fp32")
    # A cold process: importing torch and diffusers (here while the tiny pipeline is built) is
    # start-up, reported apart from the model's load.
    assert payload["startup_s"] > 1.0 and 0 <= payload["import_s"] <= payload["startup_s"]
    # The start-up is explained: the imports (with diffusers' log set-up), the tiny build and
    # the checks leave less unexplained than the imports themselves (it was most of it).
    parts = payload["import_s"] + payload["build_s"] + payload["checks_s"]
    assert payload["build_s"] > 0 and parts <= payload["startup_s"]
    assert payload["startup_s"] - parts < payload["import_s"], payload


#: A child that reports torch's import on stderr the moment it runs, then runs the CLI.
_MARK_TORCH = """
import importlib.abc, sys

class Mark(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            print("<<torch imported>>", file=sys.stderr, flush=True)
            run(module)
        spec.loader.exec_module = exec_module
        return spec

import importlib.util
sys.meta_path.insert(0, Mark())
from engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_generate_says_what_it_does_before_torch_is_imported(tmp_path: Path) -> None:
    """A newcomer's first ``generate`` was silent for 20-35 s: the first line comes before
    torch is imported, and says what is about to happen."""
    import subprocess
    import sys

    out = tmp_path / "cat.png"
    result = subprocess.run([sys.executable, "-c", _MARK_TORCH, "generate", "--tiny", "flux", "--prompt", "a cat",
                             "-o", str(out)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "<<torch imported>>" in lines, result.stderr  # the mark works: torch was imported after all
    first = lines[0]
    assert first.startswith(f"generate: 1 image with a tiny flux pipeline (random weights) into {out}"), first
    assert lines.index(first) < lines.index("<<torch imported>>")
    assert out.exists()


def test_generate_says_start_up_apart_from_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    assert main(["generate", "--tiny", "zimage", "--prompt", "a fox", "-o", str(tmp_path / "b.png"), "--width", "64",
                 "--height", "64", "--steps", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("start-up ") and "(importing torch and diffusers" in last and ", load " in last, last
    assert "building the tiny pipeline" in last and "Python and the engine" in last, last


def test_the_progress_bar_ends_once_and_is_not_redrawn_while_a_run_saves(capsys: pytest.CaptureFixture[str]) -> None:
    """A run polled after its last step (saving its LoRA) repeats step == total: the bar was
    closed once at 100% and nothing is drawn again (no 0% bar drawn and cleared per poll);
    the next run of steps (the next image) gets a bar of its own."""
    import re

    from engine.cli.images import progress_bar

    update = progress_bar("training")
    for step in range(1, 11):
        update(step, 10)
    drawn = capsys.readouterr().err
    for _ in range(50):  # the CLI polls every 0.2 s while the run saves
        update(10, 10)
    assert capsys.readouterr().err == ""  # nothing drawn, nothing cleared
    assert drawn.count("training:") >= 1 and len(re.findall(r"\b0%\|", drawn)) <= 1
    update(1, 4)  # the next image's steps
    assert "training" in capsys.readouterr().err


def test_components_are_named_as_the_family_table_names_them(capsys: pytest.CaptureFixture[str]) -> None:
    """SDXL denoises with a UNet: the plan's sizes and reasons say UNet, not transformer."""
    from engine.cli import main

    assert main(["plan", "--family", "sdxl", "--hardware", "t4"]) == 0
    shown = capsys.readouterr().out
    assert "sizes (table): UNet 5.1 GB" in shown and "transformer 5.1" not in shown
    assert "a dense UNet with no speed request" in shown
    assert main(["plan", "--family", "sdxl", "--hardware", "rtx2080ti", "--free-gb", "5", "--quant", "none"]) == 0
    assert "UNet" in capsys.readouterr().out
    assert main(["plan", "--family", "flux", "--hardware", "t4"]) == 0
    assert "sizes (table): transformer 23.8 GB" in capsys.readouterr().out
