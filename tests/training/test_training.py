"""Real LoRA training on CPU: every family, in the spawned child, round-tripped into diffusers."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.requests.training import TrainingConfig
from engine.training.preflight import TrainingPlan, preflight_training
from engine.training.records import RunRecord
from engine.training.runner import TrainingRun
from engine.training.trainer import run_training
from engine.testing.datasets import write_dataset

REGISTRY = load_registry()
#: A DiT family and the UNet family, each trained in its own spawned child, side by side. Every
#: family's trainer also runs in-process in tests/runtime/test_lora_trained.py and through its contract
#: kit (two LoRA steps); the child process is the same code for each.
FAMILIES = ["flux", "sdxl"]


def make_plan(base: Path, data: Path, **overrides: object) -> TrainingPlan:
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": 64, "steps": 4,
        "lora_rank": 4, "learning_rate": 1e-3, "device": "cpu", **overrides,
    })
    return preflight_training(REGISTRY, config, probe(verify=False))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), count=3, size=72)


@pytest.fixture(scope="module")
def trained(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, RunRecord]:
    """One real run per family, each in its own spawned child, side by side."""
    runs_root = tmp_path_factory.mktemp("runs")
    records: dict[str, RunRecord] = {}
    for pair in (FAMILIES,):
        runs = {f: TrainingRun(make_plan(tiny_pipeline(f), dataset), runs_root) for f in pair}
        for run in runs.values():
            run.start()
        for family, run in runs.items():
            records[family] = run.wait(timeout=300)
    return records


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_lora_run_finishes_with_finite_loss_and_files(family: str, trained: dict[str, RunRecord]) -> None:
    record = trained[family]
    assert record.status == "completed", record.error
    assert record.step == record.steps == 4
    losses = [v for _, v in record.metrics["loss"].points]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert all(v > 0 for _, v in record.metrics["grad_norm"].points)
    lora = load_file(record.outputs["lora"])
    ups = [v for k, v in lora.items() if "lora_B" in k or "lora_up" in k]
    assert ups and any(v.abs().sum() > 0 for v in ups), "lora_B starts at zero: training moved it"
    for chart in ("chart_loss", "chart_lr", "chart_grad_norm"):
        assert Path(record.outputs[chart]).stat().st_size > 1000
    saved = json.loads(record.path.read_text(encoding="utf-8"))
    assert saved["status"] == "completed" and saved["config"]["lora_rank"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_saved_lora_loads_into_stock_diffusers_and_changes_the_output(
    family: str, trained: dict[str, RunRecord], tiny_pipeline: Callable[[str], Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline(family))
    pipe.set_progress_bar_config(disable=True)
    spec = REGISTRY.family(family)
    size = 64

    def render() -> np.ndarray:
        generator = torch.Generator().manual_seed(3)
        kwargs = {spec.pipeline.guidance_kwarg: 1.0} if spec.pipeline.guidance_kwarg != "true_cfg_scale" else {}
        image = pipe("a red circle", num_inference_steps=2, width=size, height=size, generator=generator, **kwargs).images[0]
        return np.asarray(image).astype(int)

    before = render()
    lora = Path(trained[family].outputs["lora"])
    with caplog.at_level(logging.WARNING):
        pipe.load_lora_weights(lora.parent, weight_name=lora.name, adapter_name="trained")
    # diffusers (peft) warns "unexpected keys" / "missing keys" for keys it could not place.
    unmatched = [
        r.message for r in caplog.records
        if "unexpected key" in r.message.lower() or "missing key" in r.message.lower()
    ]
    assert unmatched == []
    denoiser = getattr(pipe, spec.pipeline.denoiser)
    injected = sum(1 for name, _ in denoiser.named_modules() if name.endswith("lora_A.trained"))
    pairs = sum(1 for key in load_file(lora) if ".lora_A." in key)
    assert injected == pairs > 0, "every saved pair landed on a module"
    # The LoRA is tiny after 4 steps: scale it up so its effect is visible in 8-bit pixels.
    pipe.set_adapters(["trained"], adapter_weights=[50.0])
    assert np.abs(render() - before).mean() > 0


@pytest.mark.slow
def test_int8_base_trains_on_cpu_and_its_adapter_round_trips(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    plan = make_plan(tiny_pipeline("flux"), dataset, base_precision="int8")
    assert plan.base_precision.value == "int8" and plan.compile.value == "off"
    events: list[dict[str, object]] = []
    result = run_training(plan, tmp_path, events.append, lambda: None)
    started = next(e for e in events if e["type"] == "started")
    assert int(started["quantised_layers"]) > 0  # type: ignore[arg-type]
    losses = [float(e["loss"]) for e in events if e["type"] == "progress"]  # type: ignore[arg-type]
    assert result["type"] == "completed" and len(losses) == 4 and np.isfinite(losses).all()
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline("flux"))
    pipe.load_lora_weights(tmp_path, weight_name="pytorch_lora_weights.safetensors")
    assert any("lora_A" in name for name, _ in pipe.transformer.named_modules())



def test_record_history_is_bounded_and_utf8(tmp_path: Path) -> None:
    record = RunRecord("r1", tmp_path, "flux", "base", {"prompt": "ünïcødé 猫"}, {}, history_limit=10)
    for step in range(1, 101):
        record.apply({"type": "progress", "step": step, "loss": 1.0 / step, "lr": 1e-4, "grad_norm": 0.5})
    record.save()
    loaded = RunRecord.load(record.path)
    assert len(loaded.metrics["loss"].points) <= 10 and loaded.metrics["loss"].points[-1][0] >= 90
    assert loaded.config["prompt"] == "ünïcødé 猫"
    assert "猫" in record.path.read_text(encoding="utf-8")


def test_dict_built_config_coerces_strings_and_names_bad_fields(tmp_path: Path) -> None:
    from engine.requests.training import InvalidConfig

    config = TrainingConfig.from_data({"base_model": "x", "dataset_dir": str(tmp_path), "epochs": "3", "batch_size": "2"})
    assert config.epochs == 3 and config.total_steps(images=5) == 8
    with pytest.raises(InvalidConfig) as raised:
        TrainingConfig.from_data({"base_model": "x", "dataset_dir": str(tmp_path), "epochs": "three", "resolution": 100})
    assert "epochs" in raised.value.message and "resolution" in raised.value.message
