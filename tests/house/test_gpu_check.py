"""bench/gpu_check.py on the CPU: the same code the GPU check runs, on the tiny pipelines.

The script is run as a user runs it (a subprocess), so its report, its table,
its per-case processes and its budget are what is checked. A case made to
raise (``--crash``) must still leave a row saying so; paths that need CUDA are
skipped with the engine's own reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import load_bench_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
#: A DiT family (every training and quantisation path) and the UNet family: the CPU rehearsal
#: of the GPU check runs the same code for every family, so two keep it inside the suite's budget.
FAMILIES = ("flux", "sdxl")
CRASHED = "sdxl/inference/int8"


def run_check(tmp_path: Path, *args: str, timeout: float = 600) -> tuple[dict, str]:
    out = tmp_path / "report" / "gpu-check.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--work", str(tmp_path / "work"), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8")), result.stdout


def rows_by_id(report: dict) -> dict[str, dict]:
    return {row["id"]: row for row in report["rows"]}


@pytest.mark.slow
def test_tiny_check_reports_every_path_and_survives_a_crashing_case(tmp_path: Path) -> None:
    report, table = run_check(tmp_path, "--crash", CRASHED, "--families", *FAMILIES)
    rows = rows_by_id(report)
    assert report["mode"] == "tiny (CPU)"
    # One row per (family, path), each with the columns the GPU report has.
    from engine.contract.plugins import load_registry

    planned = [c.id for c in load_bench().all_cases(load_registry(), list(FAMILIES))]
    assert [r["id"] for r in report["rows"]] == planned
    for row in report["rows"]:
        assert {"status", "steps_per_s", "peak_gb", "estimate_gb", "message"} <= row.keys()
        assert row["status"] in ("ok", "skipped", "error", "fallback")
        assert row["id"] in table
    # What runs on a CPU runs, with numbers, and stays finite.
    for family in FAMILIES:
        dense = rows[f"{family}/inference/dense"]
        assert dense["status"] == "ok", dense["message"]
        assert dense["steps_per_s"] > 0 and dense["finite"] is True
        assert dense["peak_gb"] > 0 and dense["estimate_gb"] > 0
        assert dense["details"]["plan"]["transformer_quant"]["value"] is None
    for family in ("flux",):
        for path in ("bf16", "int8"):
            row = rows[f"{family}/training/{path}"]
            assert row["status"] == "ok", row["message"]
            assert row["steps_per_s"] > 0 and row["finite"] is True and row["estimate_gb"] > 0
        int8 = rows[f"{family}/inference/int8"]
        assert int8["status"] == "ok", int8["message"]
        assert int8["details"]["quantised_layers"] > 0
        assert rows[f"{family}/training/int8"]["details"]["quantised_layers"] > 0
    assert rows["sdxl/training/auto"]["status"] == "ok"
    # CUDA-only paths: skipped with the engine's own preflight or plan reason.
    nf4_train = rows["flux/training/nf4"]
    assert nf4_train["status"] == "skipped" and "needs_cuda" in nf4_train["message"]
    assert "mxfp8_unsupported" in rows["flux/training/mxfp8"]["message"]
    fp8 = rows["flux/inference/fp8"]  # fp8 needs an sm89+ NVIDIA GPU: the plan takes none here
    assert fp8["status"] == "skipped" and fp8["message"].startswith("plan: transformer_quant None")
    assert "memory_mode resident" in rows["flux/inference/dense+group_offload"]["message"]
    # The crashing case is a row with its message; the cases after it still ran.
    crashed = rows[CRASHED]
    assert crashed["status"] == "error"
    assert "RuntimeError: injected failure in sdxl/inference/int8" in crashed["message"]
    assert rows["flux/training/bf16"]["status"] == "ok"
    # The spec's ratios are printed beside its B200 figures (n/a without a GPU).
    flux_ratio = next(r for r in report["ratios"] if r["family"] == "flux")
    assert flux_ratio["spec_b200"] == 2.28 and flux_ratio["measured"] == "n/a"
    assert "spec B200" in table


def test_budget_skips_cases_with_the_reason_and_still_writes_the_report(tmp_path: Path) -> None:
    report, table = run_check(tmp_path, "--budget-s", "1", "--families", "flux", "sdxl", timeout=120)
    assert report["budget_s"] == 1
    assert report["rows"], "every planned case has a row"
    for row in report["rows"]:
        assert row["status"] == "skipped"
        assert row["message"].startswith("budget: needs about"), row["message"]
        assert row["id"] in table
    assert {r["family"] for r in report["rows"]} == {"flux", "sdxl"}
    # Nothing ran, so nothing was prepared: the budget is honoured from the start.
    assert not (tmp_path / "work" / "tiny").exists()


def load_bench() -> ModuleType:
    return load_bench_script("gpu_check")


def test_real_size_configs_are_the_published_models() -> None:
    """The denoisers the GPU check builds have the tables' bf16 sizes (built on
    the meta device: no memory, no weights)."""
    import diffusers
    import torch

    from engine.contract.plugins import load_registry

    bench = load_bench()
    registry = load_registry()
    classes = {"flux": "FluxTransformer2DModel", "qwen_image": "QwenImageTransformer2DModel",
               "zimage": "ZImageTransformer2DModel", "sdxl": "UNet2DConditionModel", "wan": "WanTransformer3DModel"}
    #: The checkpoint a sheet is (the family's default where not named): Wan's is TI2V-5B, the tiny's shape.
    checkpoints = {"wan": "wan2.2-ti2v-5b"}
    for family, sheet in bench.SHEETS.items():
        with torch.device("meta"):
            model = getattr(diffusers, classes[family]).from_config(dict(sheet.config))
        gb = sum(p.numel() for p in model.parameters()) * 2 / 1e9
        spec = registry.family(family)
        table = registry.component_sizes(spec, spec.checkpoint(checkpoints.get(family, spec.default_checkpoint.name))).transformer_gb
        assert abs(gb - table) / table < 0.02, (family, gb, table)
        cond = sheet.conditioning(dict(model.config), sheet.text_tokens, 2)
        assert all(t.shape[0] == 2 for t in cond.values())


def test_nf4_conversion_quantises_every_linear_and_stays_close() -> None:
    """The in-memory nf4 path (bitsandbytes 4-bit, as the loader's nf4 config
    gives) on the CPU backend: every Linear becomes a quantised Linear4bit."""
    import bitsandbytes as bnb
    import torch

    bench = load_bench()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    reference = model(x)
    quantised = bench.to_nf4(model, torch.bfloat16, "cpu")
    layers = [m for m in quantised.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2
    assert all(layer.weight.bnb_quantized and layer.weight.quant_type == "nf4" for layer in layers)
    out = quantised(x)
    assert not torch.equal(out, reference)  # really 4-bit
    assert torch.nn.functional.cosine_similarity(out.flatten().float(), reference.flatten().float(), dim=0) > 0.95


def test_gpu_cases_are_planned_by_the_engine_for_the_gpu_found(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    """What a GPU run would do on an H200 and a B200 (presets: the hardware is
    the only fake), with the plan made from the real-size denoiser's shapes."""
    from engine.hardware.presets import preset
    from engine.contract.plugins import load_registry
    from engine.policy.inference import plan_inference

    bench = load_bench()
    registry = load_registry()
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "flux").symlink_to(tiny_pipeline("flux"), target_is_directory=True)
    settings = bench.Settings(tiny=False, work=tmp_path, infer_resolution=1024, infer_steps=8,
                              train_resolution=512, train_steps=20, warmup_steps=5, lora_rank=16)
    model = bench.BenchModel("flux", settings)  # full size, on the meta device
    facts = model.facts()
    assert abs(facts.measured_sizes.transformer_gb - 23.8) < 0.1
    assert facts.measured_scheme_gb["nf4"] < facts.measured_scheme_gb["int8"] < facts.measured_sizes.transformer_gb

    def verdicts(name: str) -> dict[str, str]:
        found = {}
        for case in bench.all_cases(registry, ["flux"]):
            try:
                bench.precheck(case, registry, preset(name), settings, facts)
                found[f"{case.kind}/{case.path}"] = "runs"
            except bench.Skip as why:
                found[f"{case.kind}/{case.path}"] = str(why)
        return found

    h200, b200 = verdicts("h200"), verdicts("b200")
    for path in ("training/bf16+compile", "training/nf4", "training/bf16+compile-static", "training/fp8",
                 "training/int8", "inference/dense", "inference/fp8", "inference/int8", "inference/nf4",
                 "inference/dense+compile", "inference/dense+group_offload", "inference/int8+sequential_offload"):
        assert h200[path] == "runs", (path, h200[path])
    assert "mxfp8_unsupported" in h200["training/mxfp8"]
    assert "Blackwell" in h200["inference/nvfp4"]
    assert "datacenter" in h200["inference/dense+fp16-accumulation"]
    assert b200["training/mxfp8"] == b200["inference/mxfp8"] == b200["inference/nvfp4"] == "runs"
    # The estimate a row is compared with: the plan's denoiser + overhead, resident.
    plan = plan_inference(registry, facts, preset("h200"), bench.inference_request(
        bench.Case("flux", "inference", "dense", 0), settings))
    gb, detail = bench.denoiser_estimate(plan)
    assert plan.value("memory_mode") == "resident" and 24 < gb < 28 and detail.startswith("resident")


def test_ratios_put_the_measured_figures_beside_the_spec() -> None:
    bench = load_bench()
    rows = [
        bench.Row("flux", "training", "bf16+compile", "ok", steps_per_s=4.0),
        bench.Row("flux", "training", "nf4", "ok", steps_per_s=2.0),
        bench.Row("zimage", "training", "bf16+compile", "ok", steps_per_s=6.0),
        bench.Row("zimage", "training", "nf4", "oom"),
        bench.Row("zimage", "training", "bf16+compile-static", "ok", steps_per_s=4.0),
        bench.Row("sdxl", "training", "auto+compile", "ok", steps_per_s=9.0),
    ]
    found = {(r["family"], r["ratio"]): r for r in bench.ratios(rows)}
    flux = found[("flux", "training bf16+compile / nf4")]
    assert flux["measured"] == 2.0 and flux["spec_b200"] == 2.28
    zimage = found[("zimage", "training bf16+compile / nf4")]
    assert zimage["measured"] == "n/a" and zimage["spec_b200"] == 2.55  # nf4 ran out of memory
    assert found[("zimage", "training compile dynamic / static")]["measured"] == 1.5
    assert found[("zimage", "training compile dynamic / static")]["spec_b200"] == 1.66
    assert not any(family == "sdxl" for family, _ in found)  # no spec figure, nothing measured to compare


@pytest.mark.slow
def test_tiny_check_renders_a_wan_clip_through_the_engine(tmp_path: Path) -> None:
    """The video case: the clip rendered whole by the engine's generate (dense and int8 on
    the tiny Wan), with its speed, peak and the plan's estimate, as the GPU run will."""
    report, table = run_check(tmp_path, "--families", "wan")
    rows = rows_by_id(report)
    assert [r["id"] for r in report["rows"]] == ["wan/inference/video", "wan/inference/video+int8",
                                                 "wan/inference/video+model_offload"]
    for path in ("video", "video+int8"):
        row = rows[f"wan/inference/{path}"]
        assert row["status"] == "ok", row["message"]
        assert row["steps_per_s"] > 0 and row["finite"] is True
        assert row["peak_gb"] > 0 and row["estimate_gb"] > 0
    assert rows["wan/inference/video+int8"]["details"]["quantised_layers"] > 0
    assert rows["wan/inference/video"]["details"]["plan"]["vae_tiling"]["value"] == 0  # video always tiles
    offload = rows["wan/inference/video+model_offload"]
    assert offload["status"] == "skipped" and "memory_mode resident" in offload["message"]
    assert "wan/inference/video" in table
