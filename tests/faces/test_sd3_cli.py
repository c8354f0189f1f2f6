"""The worked third-party family (examples/diffusion-engine-sd3, installed as a plugin)
from the terminal: the CLI finds it by its entry point, generates with it and plans
a training run for it, exactly as for a built-in family.

In-process ``main([...])`` calls on its tiny random-weight pipeline (64 px, CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from engine.cli import main
from engine.contract.plugins import load_registry
from engine.testing.datasets import write_dataset

pytestmark = pytest.mark.skipif(
    "sd3" not in load_registry().families,
    reason="the sd3 example plugin is not installed (pip install -e examples/diffusion-engine-sd3)",
)


def test_cli_generates_with_the_third_party_family(tmp_path: Path) -> None:
    out = tmp_path / "sd3.png"
    assert main(["generate", "--tiny", "sd3", "--steps", "1", "--prompt", "a red cube", "--seed", "1",
                 "-o", str(out)]) == 0
    image = Image.open(out)
    assert image.size == (64, 64)
    assert json.loads(image.text["diffusion-engine"])["prompt"] == "a red cube"


def test_cli_plans_a_training_run_for_the_third_party_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_dataset(tmp_path / "data", count=2)
    assert main(["train", "--tiny", "sd3", "--device", "cpu", "--steps", "1", "--data", str(data),
                 "--runs-dir", str(tmp_path / "runs"), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["family"] == "sd3" and plan["steps"] == 1 and plan["device"] == "cpu"
    assert plan["lora_targets"]  # the family's own table named what a LoRA trains
    assert not (tmp_path / "runs").exists()  # a dry run starts nothing
