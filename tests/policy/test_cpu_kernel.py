"""The CPU plan's dtype and GEMM kernel, from the ISA and the GEMM speeds measured on the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.hardware.cpu import matmul_isa
from engine.hardware.presets import preset
from engine.hardware.profile import CpuGemm
from tests.support import table_plan

SAPPHIRE_RAPIDS = preset("cpu").replace(total_memory_gb=128.0, free_memory_gb=120.0, cpu_isa="AMX-BF16", cpu_bf16_matmul=True,
                                        cpu_gemm=CpuGemm(374.5, 383.0, 2159.9, 2))  # measured on a 2-core VM
ZEN5 = preset("cpu").replace(total_memory_gb=128.0, free_memory_gb=120.0, cpu_isa="AVX512-BF16", cpu_bf16_matmul=True, cpu_gemm=CpuGemm(154.0, 330.0, 604.0, 2))
AVX2 = preset("cpu").replace(total_memory_gb=128.0, free_memory_gb=120.0, cpu_isa="AVX2", cpu_gemm=CpuGemm(150.0, 160.0, 40.0, 2))


def test_a_speed_tier_computes_in_bf16_where_the_cpu_multiplies_it_natively() -> None:
    controls = table_plan("flux", SAPPHIRE_RAPIDS, speed="default")
    assert controls["dtype"].value == "bf16" and "AMX-BF16" in controls["dtype"].reason
    assert "5.6x" in controls["dtype"].reason and controls["cpu_kernel"].value == "onednn"
    assert table_plan("flux", ZEN5, speed="default")["dtype"].value == "bf16"


def test_the_default_computes_bf16_where_the_cpu_multiplies_it_and_speed_off_stays_exact() -> None:
    default = table_plan("flux", SAPPHIRE_RAPIDS)["dtype"]
    assert default.value == "bf16" and "AMX-BF16" in default.reason and "--dtype fp32" in default.reason
    assert table_plan("flux", ZEN5)["dtype"].value == "bf16"
    exact = table_plan("flux", SAPPHIRE_RAPIDS, speed="off")["dtype"]
    assert exact.value == "fp32" and "the default computes in bf16 here" in exact.reason and "AMX-BF16" in exact.reason
    assert table_plan("flux", ZEN5, speed="off")["cpu_kernel"].value == "mkl"  # the off tier keeps torch's kernel
    assert table_plan("flux", AVX2)["dtype"].value == "fp32"  # emulated bf16 is slower


def test_fp32_takes_onednn_only_where_measured_faster() -> None:
    zen = table_plan("flux", ZEN5, speed="default", dtype="fp32")["cpu_kernel"]
    assert zen.value == "onednn" and "2.1x" in zen.reason
    avx2 = table_plan("flux", AVX2, speed="default")
    assert avx2["dtype"].value == "fp32" and "AVX2" in avx2["dtype"].reason  # emulated bf16 is slower
    assert avx2["cpu_kernel"].value == "mkl"
    assert table_plan("flux", preset("rtx4090"))["cpu_kernel"].value is None


def test_the_isa_is_read_from_the_cpu_flags() -> None:
    assert matmul_isa(frozenset({"avx2", "avx512f", "amx_bf16"})) == "AMX-BF16"
    assert matmul_isa(frozenset({"avx2", "avx512f"})) == "AVX-512"
    assert matmul_isa(frozenset()) == ""


@pytest.mark.slow
def test_the_gemm_figures_are_measured_once_and_read_back_without_torch(tmp_path: Path) -> None:
    cache = tmp_path / "gemm.json"
    env = {"DIFFUSION_ENGINE_CPU_GEMM": str(cache), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    measure = "from engine.hardware.probe import probe; print(probe(verify=True).cpu_gemm.bf16)"
    subprocess.run([sys.executable, "-c", measure], env=env, check=True, capture_output=True)
    entries = json.loads(cache.read_text())
    (entry,) = entries.values()
    assert entry["fp32_mkl"] > 0 and entry["bf16"] > 0
    assert isinstance(entry["measured_epoch"], float) and "load" in entry  # their age and load, quoted with them
    read = ("import sys, json; from engine.hardware.probe import probe; g = probe(verify=False).cpu_gemm;"
            " print(json.dumps([g.fp32_mkl, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", read], env=env, check=True, capture_output=True, text=True)
    assert json.loads(out.stdout) == [entry["fp32_mkl"], False]


def test_figures_are_measured_again_when_stale_or_taken_under_load(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry read back carries its date and load (quoted in the plan's reason); one older than
    30 days, one taken at a load above the cores more than an hour ago, or one without its time
    (an earlier version's) is not read back, so the next verified probe measures again."""
    import time

    from engine.hardware import gemm

    monkeypatch.setenv(gemm.ENV_FILE, str(tmp_path / "gemm.json"))
    monkeypatch.setattr(gemm, "physical_cores", lambda: 2)
    now = time.time()

    def entry(age: float, load: float | None) -> dict[str, object]:
        return {"fp32_mkl": 170.0, "fp32_onednn": 215.0, "bf16": 430.0, "threads": 2,
                "measured_at": "2026-12-01T10:00:00", "measured_epoch": now - age, "load": load}

    key = gemm.cache_key("AVX512-BF16", 2)
    for age, load, kept in ((60.0, 0.5, True), (40 * 86400.0, 0.5, False), (2 * 3600.0, 9.0, False),
                            (60.0, 9.0, True), (60.0, None, True)):
        (tmp_path / "gemm.json").write_text(json.dumps({key: entry(age, load)}))
        figures = gemm.cached("AVX512-BF16", 2)
        assert (figures is not None) == kept, (age, load)
        if figures is not None:
            assert figures.measured_on == "2026-12-01" and figures.when.startswith(", 2026-12-01")
    (tmp_path / "gemm.json").write_text(json.dumps({key: {k: v for k, v in entry(60.0, 0.5).items()
                                                           if k != "measured_epoch"}}))
    assert gemm.cached("AVX512-BF16", 2) is None
