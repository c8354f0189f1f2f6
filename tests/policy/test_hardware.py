"""Hardware profiles: capability rules, presets, and the real probe."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import UnknownName
from engine.hardware.presets import PRESETS, preset
from engine.hardware.probe import probe
from engine.hardware.profile import native_bf16

REQUIRED_PRESETS = {
    "cpu", "t4", "v100", "rtx2080ti", "rtx3090", "rtx4090", "rtx5090", "a100-40g",
    "a100-80g", "l40s", "h100", "h200", "b200", "mi300x", "apple-m3-max",
}


def test_presets_cover_the_machines_users_have() -> None:
    assert REQUIRED_PRESETS <= set(PRESETS)


@pytest.mark.parametrize(
    ("name", "bf16", "fp8", "mxfp8", "cuda"),
    [
        ("t4", False, False, False, True),
        ("v100", False, False, False, True),
        ("rtx2080ti", False, False, False, True),
        ("rtx3090", True, False, False, True),
        ("a100-80g", True, False, False, True),
        ("rtx4090", True, True, False, True),
        ("l40s", True, True, False, True),
        ("h100", True, True, False, True),
        ("b200", True, True, True, True),
        ("rtx5090", True, True, True, True),
        ("mi300x", True, False, False, True),
        ("apple-m3-max", True, False, False, False),
        ("cpu", True, False, False, False),
    ],
)
def test_capabilities_follow_the_rules(name: str, bf16: bool, fp8: bool, mxfp8: bool, cuda: bool) -> None:
    hw = preset(name)
    assert (hw.native_bf16, hw.fp8, hw.mxfp8, hw.cuda) == (bf16, fp8, mxfp8, cuda)


def test_nvidia_bf16_ignores_torchs_emulation_answer() -> None:
    # torch.cuda.is_bf16_supported() says True on a T4: emulation, not native.
    assert native_bf16("nvidia", (7, 5), torch_reports_bf16=True) is False
    assert native_bf16("nvidia", (8, 0), torch_reports_bf16=False) is True
    # ROCm's answer is trustworthy.
    assert native_bf16("rocm", None, torch_reports_bf16=True) is True
    assert native_bf16("rocm", None, torch_reports_bf16=False) is False


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(UnknownName) as raised:
        preset("rtx9090")
    assert raised.value.code == "unknown_preset" and "rtx4090" in raised.value.message


def test_consumer_flag_marks_consumer_and_workstation_cards() -> None:
    # Workstation cards (RTX A4000) and unknown names share the consumer
    # policy; datacenter parts and the RTX 6000 Ada do not.
    assert {n for n, p in PRESETS.items() if p.consumer} == {
        "rtx2080ti", "rtx3090", "rtx4090", "rtx5090", "rtx-a4000", "dgx-spark"
    }


def test_light_probe_reads_this_machine_without_torch() -> None:
    code = (
        "import json, sys\n"
        "from engine.hardware.probe import probe\n"
        "p = probe()\n"
        "print(json.dumps({'vendor': p.vendor, 'cpus': p.cpu_count, 'cores': p.physical_cores,"
        " 'total': p.total_memory_gb, 'torch': 'torch' in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["torch"] is False
    assert result["cpus"] == len(os.sched_getaffinity(0))  # the CPUs this process may use
    if result["vendor"] == "cpu" and Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").exists():
        assert 1 <= result["cores"] <= result["cpus"]
    assert result["total"] > 0
    if not Path("/dev/nvidia0").exists():
        assert result["vendor"] == "cpu"


def _fake_nvidia_smi(bin_dir: Path, line: str) -> None:
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '{line}'\n", encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize(
    ("line", "capability", "consumer", "bf16"),
    [
        ("NVIDIA GeForce RTX 4090, 8.9, 24564, 23000", (8, 9), True, True),
        ("Tesla T4, 7.5, 15360, 15000", (7, 5), False, False),
        # A workstation card: consumer-class policy (int8 first, fp16 accumulation).
        ("NVIDIA RTX A6000, 8.6, 49140, 48000", (8, 6), True, True),
        ("NVIDIA RTX 6000 Ada Generation, 8.9, 49140, 48000", (8, 9), False, True),
    ],
)
def test_light_probe_parses_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, capability: tuple[int, int],
    consumer: bool, bf16: bool,
) -> None:
    """Fake only the hardware: an nvidia-smi on PATH that prints one GPU."""
    _fake_nvidia_smi(tmp_path, line)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    hw = probe(verify=False)
    assert hw.vendor == "nvidia" and hw.capability == capability
    assert hw.consumer is consumer and hw.native_bf16 is bf16
    assert hw.total_memory_gb == pytest.approx(float(line.split(", ")[2]) * 2**20 / 1e9)


@pytest.mark.parametrize(("visible", "names"), [(None, ["H100", "T4", "H100"]), ("2,1", ["H100", "T4"]), ("0", None)])
def test_every_gpu_nvidia_smi_lists_is_a_device_in_visible_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None, names: list[str] | None
) -> None:
    """A multi-GPU box as nvidia-smi lists it (one line per GPU), narrowed by CUDA_VISIBLE_DEVICES."""
    from engine.hardware.devices import probed_devices

    _fake_nvidia_smi(tmp_path, "H100, 9.0, 81559, 80000\nT4, 7.5, 15360, 15000\nH100, 9.0, 81559, 1000")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    box = probed_devices(probe(verify=False))
    assert [d.name for d in box.devices] == (names or [])  # one visible GPU: the profile itself, no list
    if visible is None:
        assert box.devices[1].capability == (7, 5) and box.devices[2].free_memory_gb == pytest.approx(1000 * 2**20 / 1e9)


STUB_TORCHAO = {
    "torchao/__init__.py": "",
    "torchao/quantization/__init__.py": (
        "class Int8WeightOnlyConfig:\n    pass\n\n"
        "def quantize_(model, config):\n    return model  # the stub: imports fine, does nothing\n"
    ),
}


def _torchao_functional_in_child(pythonpath: str | None) -> bool:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", "from engine.hardware.probe import torchao_functional; print(torchao_functional())"],
        capture_output=True, text=True, check=True, env=env,
    )
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.slow
def test_torchao_functional_runs_the_int8_call_and_catches_a_stub(tmp_path: Path) -> None:
    assert _torchao_functional_in_child(None) is True
    for relative, source in STUB_TORCHAO.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(source, encoding="utf-8")
    assert _torchao_functional_in_child(str(tmp_path)) is False


@pytest.mark.slow
def test_torchao_missing_symbols_are_not_functional(tmp_path: Path) -> None:
    (tmp_path / "torchao").mkdir()
    (tmp_path / "torchao" / "__init__.py").write_text("", encoding="utf-8")
    assert _torchao_functional_in_child(str(tmp_path)) is False


def test_verified_probe_on_a_cpu_machine_reports_no_bitsandbytes() -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("this check is about machines without a GPU")
    hw = probe(verify=True)
    assert hw.source == "probe+torch" and hw.vendor == "cpu"
    assert hw.bitsandbytes_usable is False
    assert hw.torchao_functional is True


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    """A fake /sys/devices/system/cpu: each CPU's thread-sibling list."""
    for cpu, listed in siblings.items():
        (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(f"{listed}\n", encoding="ascii")
    return root


@pytest.mark.parametrize(("siblings", "cores"), [
    ({0: "0", 1: "1"}, 2),  # this machine: two cores, no SMT
    ({0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}, 2),  # two cores, two threads each
    ({0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3", 4: "4", 5: "5"}, 4),  # a hybrid part: SMT P-cores, lone E-cores
])
def test_physical_cores_count_smt_siblings_once(tmp_path: Path, siblings: dict[int, str], cores: int) -> None:
    from engine.hardware.cpu import physical_cores

    root = _topology(tmp_path / "cpu", siblings)
    assert physical_cores(str(root), set(siblings)) == cores
    assert physical_cores(str(root), {0, 1}) == (1 if siblings[0] == siblings[1] else 2)  # only the CPUs we may use
    assert physical_cores(str(root), {*siblings, 99}) is None  # one unreadable CPU: unknown, not a guess


def test_a_two_core_machine_without_smt_plans_two_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The halving rule gave this 2-core machine 1 thread: every CPU path ran on half of it."""
    from engine.hardware import cpu, probe as probing
    from tests.support import table_plan

    monkeypatch.setattr(cpu, "CPU_TOPOLOGY", str(_topology(tmp_path / "cpu", {0: "0", 1: "1"})))
    monkeypatch.setattr(probing.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(probing, "_nvidia_smi", lambda: None)
    profile = probing.probe(verify=False)
    assert (profile.vendor, profile.cpu_count, profile.physical_cores) == ("cpu", 2, 2)
    threads = table_plan("sdxl", profile)["threads"]
    assert threads.value == 2 and "2 physical cores" in threads.reason
    assert table_plan("sdxl", profile.replace(cpu_count=4, physical_cores=2))["threads"].value == 2
