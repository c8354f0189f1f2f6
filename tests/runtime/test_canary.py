"""The numeric canary: a scheme that breaks a real slice of the model is caught
before generation (the fallback loads, with the measured values) and before a
training start (refused, nothing evicted)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.model import resolve_model
from engine.runtime.canary import run_linear
from engine.training.canary import CANARY_MIN_STEPS, TrainingCanaryFailed, training_canary
from engine.runtime.session import InferenceSession
from engine.testing.datasets import write_dataset
from engine.requests.training import TrainingConfig
from engine.training.preflight import preflight_training
from tests.support import HostModel

REGISTRY = load_registry()
HARDWARE = probe(verify=False)


@pytest.fixture(scope="module")
def poisoned(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX pipeline with one overflowing weight in each Linear of its
    first blocks (double- and single-stream): any scheme's forward there is non-finite."""
    folder = tmp_path_factory.mktemp("poisoned") / "flux"
    shutil.copytree(tiny_pipeline("flux"), folder)
    [weights] = (folder / "transformer").glob("*.safetensors")
    state = load_file(weights)
    for name, tensor in state.items():
        if "blocks.0." in name and name.endswith(".weight") and tensor.ndim == 2:
            tensor[0, 0] = float("inf")
    save_file(state, weights, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), count=1, size=64)


def test_the_canary_judges_finite_and_not_constant() -> None:
    layer = torch.nn.Linear(32, 16)
    good = run_linear(layer, "probe", scheme="bf16", dtype=torch.float32, device="cpu")
    assert good.ok and good.values["finite_fraction"] == 1.0 and good.values["std"] > 0
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.fill_(0.5)
    flat = run_linear(layer, "probe", scheme="bf16", dtype=torch.float32, device="cpu")
    assert not flat.ok and "constant" in flat.reason


def test_a_layer_whose_kernel_cannot_run_here_fails_the_canary_instead_of_the_load() -> None:
    """torchao's mxfp8 quantises a bf16 layer on a CPU, then its GEMM raises: the canary says so and
    the planned fallback builds instead of the load failing."""

    class Unrunnable(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("Invalid scaling configuration.")

    result = run_linear(Unrunnable(32, 16), "probe", scheme="mxfp8", dtype=torch.bfloat16, device="cpu")
    assert not result.ok and "could not run" in result.reason and "Invalid scaling configuration" in result.reason


def session(model: Path, request: InferenceRequest) -> InferenceSession:
    source = resolve_model(REGISTRY, model)
    return InferenceSession(REGISTRY, source, plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, request), request)


@pytest.mark.slow
def test_a_scheme_producing_nan_falls_back_before_generation(
    poisoned: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    # fp32 asked: the dense fallback then runs no canary of its own (a bf16 one would judge the
    # same poisoned weights), so the scheme's failure is what this checks
    broken = session(poisoned, InferenceRequest(quant="int8", dtype="fp32"))
    broken.load()
    try:
        status = broken.status()
        assert broken.plan.value("transformer_quant") is None  # the dense fallback was loaded
        fallback = status["fallback"]
        assert fallback["code"] == "canary_failed"  # type: ignore[index]
        assert "non-finite" in fallback["reason"] and "finite_fraction" in fallback["reason"]  # type: ignore[index]
    finally:
        broken.unload()
    clean = session(tiny_pipeline("flux"), InferenceRequest(quant="int8"))
    clean.load()
    try:
        canary = clean.status()["canary"]
        assert canary["ok"] and canary["scheme"] == "int8" and "blocks.0." in canary["layer"]  # type: ignore[index]
        assert canary["cost_s"] < 1.0  # type: ignore[index]
        assert clean.plan.value("transformer_quant") == "int8"
    finally:
        clean.unload()


def config(base: Path, data: Path, tmp_path: Path, steps: int) -> TrainingConfig:
    return TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": 64, "steps": steps,
        "lora_rank": 4, "device": "cpu", "output_dir": str(tmp_path / "out"),
    })


def test_a_broken_scheme_refuses_the_training_start_before_eviction(
    poisoned: Path, dataset: Path, tmp_path: Path
) -> None:
    engine = Engine(registry=REGISTRY, hardware=HARDWARE, runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    with pytest.raises(TrainingCanaryFailed) as refused:
        engine.training.start(config(poisoned, dataset, tmp_path, CANARY_MIN_STEPS))
    assert refused.value.code == "canary_failed"
    assert "non-finite" in refused.value.message and "nothing was evicted" in refused.value.message
    assert refused.value.result.layer and "blocks.0." in refused.value.result.layer
    assert host.evicted == 0 and engine.training.status() is None


def test_the_training_canary_passes_a_sound_base_and_skips_tiny_runs(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    long_run = preflight_training(REGISTRY, config(tiny_pipeline("flux"), dataset, tmp_path, CANARY_MIN_STEPS), HARDWARE)
    result = training_canary(long_run)
    assert result.ok and not result.skipped and result.values["finite_fraction"] == 1.0
    short = preflight_training(REGISTRY, config(tiny_pipeline("flux"), dataset, tmp_path, 3), HARDWARE)
    skipped = training_canary(short)
    assert skipped.skipped and "3-step run" in skipped.reason
