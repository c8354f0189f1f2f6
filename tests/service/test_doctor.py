"""doctor: versions, then per family what this machine does, why, and what would do better."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from engine import Engine
from engine.service.doctor import PACKAGES, doctor_report, format_doctor
from engine.hardware.presets import preset
from engine.contract.plugins import load_registry

REGISTRY = load_registry()


def report(name: str) -> dict[str, object]:
    return doctor_report(Engine(registry=REGISTRY, hardware=preset(name)), hardware=preset(name))


def test_t4_verdicts_say_what_runs_why_and_what_would_do_better() -> None:
    t4 = report("t4")
    families = t4["families"]
    assert set(families) == set(REGISTRY.families)  # type: ignore[arg-type]
    flux = families["flux"]  # type: ignore[index]
    assert flux["inference"]["ok"] and "fp16" in flux["inference"]["does"]
    assert not flux["training"]["ok"] and "native bf16" in flux["training"]["reason"]
    assert any("Ampere" in b for b in flux["training"]["better"])
    assert families["sdxl"]["training"]["ok"]  # type: ignore[index]
    assert not families["zimage"]["inference"]["ok"]  # type: ignore[index]  # fp16 unsafe, fp32 too big
    assert set(PACKAGES) | {"cuda"} == set(t4["versions"])  # type: ignore[arg-type]
    json.dumps(t4)  # the --json form
    text = format_doctor(t4).splitlines()
    assert text[0].startswith("versions: torch") and "sm75" in text[1]
    assert len(text) == 2 + 2 * len(REGISTRY.families)


def test_h100_suggests_flash3_and_trains_in_bf16() -> None:
    flux = report("h100")["families"]["flux"]  # type: ignore[index]
    assert "trains in bf16" in flux["training"]["does"]
    assert any("kernels" in b for b in flux["inference"]["better"])


@pytest.mark.slow
def test_doctor_on_this_machine_prints_no_library_noise_and_names_flags() -> None:
    """The terminal's doctor: verdicts on stdout only, and their advice in the flags a user types."""
    out = subprocess.run([sys.executable, "-m", "engine", "doctor"], capture_output=True, text=True, check=True)
    assert out.stderr == ""
    assert out.stdout.startswith("versions: torch ")
    assert "--device cpu" in out.stdout or "--quant int8" in out.stdout  # this CPU machine is told one or both
    assert not re.search(r"(?<![\w-])(device|quant|text_encoder_quant)=", out.stdout), out.stdout
