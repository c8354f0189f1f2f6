"""``make demo`` as a newcomer runs it, then the command it ends on."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_demo_leaves_a_run_whose_base_exists_and_its_last_command_works(tmp_path: Path) -> None:
    """The run record named a deleted temporary folder as its base, so the LoRA the demo
    trained could not be used after it. Its base now stays in out/, and the command the demo
    prints last (generate with that LoRA) runs as printed."""
    demo = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    (record,) = (tmp_path / "out" / "runs").glob("*/run.json")
    base = tmp_path / json.loads(record.read_text())["base_model"]  # relative to where the demo ran
    assert (base / "model_index.json").is_file(), base
    (last,) = [line for line in demo.stdout.splitlines() if line.startswith("Next, the LoRA on its base: ")]
    command = shlex.split(last.split(": ", 1)[1])
    assert command[0] == "diffusion-engine" and "--lora" in command
    result = subprocess.run([sys.executable, "-m", "engine", *command[1:]], cwd=tmp_path, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "LoRA" in result.stdout and Image.open(tmp_path / "out" / "demo-lora.png").size == (64, 64)


def test_a_second_demo_reuses_its_base_so_earlier_runs_keep_theirs(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    folder = demo._tiny_flux(tmp_path / "tiny-flux")
    weights = sorted(folder.rglob("*.safetensors"))
    stamps = [path.stat().st_mtime_ns for path in weights]
    assert weights and demo._tiny_flux(folder) == folder
    assert [path.stat().st_mtime_ns for path in weights] == stamps  # not rebuilt
