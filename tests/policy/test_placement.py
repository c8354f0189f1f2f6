"""Quantise on the way in, and every placement failure goes through the planned fallback.

Real tiny pipelines on the CPU; the only fake is the GPU running out of
memory, raised once from the placement helper every move goes through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.model import resolve_model
from engine.runtime import quantize
from engine.runtime.quantize import PlacementFailed, placing, quantize_on_host_then_place
from engine.runtime.session import GenerateRequest, InferenceSession
from engine.service.facade import Engine
from engine.testing.datasets import write_dataset
from engine.requests.training import TrainingConfig
from engine.training.preflight import preflight_training
from engine.training.trainer import run_training

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
OOM = "CUDA out of memory. Tried to allocate 20.00 GiB"


def session_for(model: Path, request: InferenceRequest) -> InferenceSession:
    source = resolve_model(REGISTRY, model)
    plan = plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, request)
    return InferenceSession(REGISTRY, source, plan, request)


@pytest.fixture
def oom_once(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The first placement runs out of GPU memory; later ones go through.
    Returns what each placement was asked to move."""
    real = quantize.move_to
    moved: list[str] = []

    def move_to(module: Any, device: str, what: str) -> None:
        moved.append(what)
        if len(moved) == 1:
            with placing(what, device):
                raise torch.OutOfMemoryError(OOM)
        real(module, device, what)

    monkeypatch.setattr(quantize, "move_to", move_to)
    return moved


def is_quantised(weight: torch.Tensor) -> bool:
    return type(weight) not in (torch.Tensor, torch.nn.Parameter)


def quantisable(model: torch.nn.Module, keep: Callable[[torch.nn.Module, str], bool]) -> list[torch.nn.Linear]:
    return [m for n, m in model.named_modules() if keep(m, n)]  # type: ignore[misc]


# -- inference -----------------------------------------------------------------


@pytest.mark.slow
def test_oom_placing_the_int8_transformer_loads_the_planned_fallback_and_says_why(
    tiny_pipeline: Callable[[str], Path], oom_once: list[str]
) -> None:
    session = session_for(tiny_pipeline("flux"), InferenceRequest(quant="int8"))
    assert session.plan.value("transformer_quant") == "int8" and session.plan.fallback is not None
    session.load()
    try:
        status = session.status()
        quant = status["plan"]["resolved"]["transformer_quant"]  # type: ignore[index]
        assert quant["value"] is None and quant["source"] == "explicit"
        assert "the int8 build failed: ran out of memory" in quant["reason"] and OOM in quant["reason"]
        assert status["fallback"] == {
            "code": "placement_failed", "reason": quant["reason"],
            "from": {"transformer_quant": "int8", "memory_mode": "resident"},
        }
        assert status["placement"] is None and status["quantised_layers"] == 0
        assert not any(is_quantised(p) for p in session.denoiser.parameters())
        [image] = session.generate(GenerateRequest("a lighthouse", steps=2, width=64, height=48))
        assert np.asarray(image).shape == (48, 64, 3)
    finally:
        session.unload()
    assert oom_once[0] == "the int8 model" and oom_once[1:] == ["the pipeline"]


@pytest.mark.slow
def test_the_fallback_reason_reaches_engine_status(
    tiny_pipeline: Callable[[str], Path], oom_once: list[str], tmp_path: Path
) -> None:
    engine = Engine(registry=REGISTRY, hardware=HARDWARE, runs_dir=tmp_path)
    engine.images.load(str(tiny_pipeline("flux")), request=InferenceRequest(quant="int8"))
    try:
        pipeline = engine.status()["pipeline"]
        assert pipeline["loaded"] and pipeline["fallback"]["code"] == "placement_failed"  # type: ignore[index]
        assert OOM in pipeline["fallback"]["reason"]  # type: ignore[index]
    finally:
        engine.images.unload()


@pytest.mark.slow
def test_oom_without_a_fallback_is_a_typed_refusal_that_says_what_to_do(
    tiny_pipeline: Callable[[str], Path], oom_once: list[str]
) -> None:
    session = session_for(tiny_pipeline("zimage"), InferenceRequest(quant="none"))
    assert session.plan.fallback is None
    with pytest.raises(PlacementFailed) as raised:
        session.load()
    assert raised.value.code == "placement_failed" and raised.value.out_of_memory
    assert OOM in raised.value.message and "--memory" in raised.value.message
    assert session.status()["loaded"] is False


@pytest.mark.slow
def test_int8_transformer_is_quantised_block_by_block_on_the_host_before_it_moves(
    tiny_pipeline: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchao.quantization

    quantised_roots: list[str] = []
    real_quantize = torchao.quantization.quantize_

    def quantize_(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        quantised_roots.append(type(model).__name__)
        real_quantize(model, *args, **kwargs)

    seen_at_move: list[tuple[str, bool]] = []
    real_move = quantize.move_to

    def move_to(module: Any, device: str, what: str) -> None:
        if isinstance(module, torch.nn.Module):
            # The session filters with the family's int8 exclusions (its table).
            flux_dense = REGISTRY.family("flux").quantisation.int8_dense_modules
            layers = quantisable(module, quantize.module_filter("int8", flux_dense))
            seen_at_move.append((what, bool(layers) and all(is_quantised(m.weight) for m in layers)))
        real_move(module, device, what)

    monkeypatch.setattr(torchao.quantization, "quantize_", quantize_)
    monkeypatch.setattr(quantize, "move_to", move_to)
    session = session_for(tiny_pipeline("flux"), InferenceRequest(quant="int8"))
    session.load()
    try:
        placement = session.status()["placement"]
        denoiser = session.denoiser
    finally:
        session.unload()
    blocks = [name for name, _ in quantize.repeated_blocks(denoiser)]
    assert len(blocks) >= 2
    assert placement["site"] == "host" and placement["blocks"] == len(blocks)  # type: ignore[index]
    assert "on the host, block by block" in placement["path"]  # type: ignore[index]
    # One call per repeated block, then one for the rest of the model.
    assert len(quantised_roots) == len(blocks) + 1
    assert quantised_roots[-1] == type(denoiser).__name__
    assert set(quantised_roots[:-1]) <= {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    assert seen_at_move[0] == ("the int8 model", True)


class Tiny(torch.nn.Module):
    """Two block lists and loose layers: the shape of a DiT."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(512, 512)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(512, 512)) for _ in range(2))
        self.single = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(512, 512)) for _ in range(1))
        self.proj_out = torch.nn.Linear(512, 512)


@pytest.mark.parametrize("resident", [True, False])
def test_device_site_moves_one_block_quantises_it_then_the_next(
    monkeypatch: pytest.MonkeyPatch, resident: bool
) -> None:
    """The path for schemes torchao quantises only on the GPU: the dense peak
    there is one block. The device here is the CPU; the order is the point."""
    events: list[str] = []
    monkeypatch.setattr(quantize, "move_to", lambda module, device, what: events.append(f"move {what} -> {device}"))

    def transform(module: torch.nn.Module, keep: Callable[[torch.nn.Module, str], bool]) -> None:
        names = [name for name, m in module.named_modules() if keep(m, name)]
        events.append(f"quantise {names}")

    keep_all: Callable[[torch.nn.Module, str], bool] = lambda m, n: isinstance(m, torch.nn.Linear)
    placement = quantize_on_host_then_place(
        Tiny(), "fp8", "cpu", resident=resident, transform=transform, keep=keep_all, site="device"
    )
    back = ["move block {} -> cpu"] if not resident else []
    expected: list[str] = []
    for block in ("blocks.0", "blocks.1", "single.0"):
        expected += [f"move block {block} -> cpu", "quantise ['0']"]
        expected += [b.format(block) for b in back]
    expected += ["move the layers outside the repeated blocks -> cpu", "quantise ['embed', 'proj_out']"]
    expected += ["move the layers outside the repeated blocks -> cpu"] if not resident else ["move the fp8 model -> cpu"]
    assert events == expected
    assert (placement.site, placement.blocks, placement.layers, placement.resident) == ("device", 3, 5, resident)


def test_block_filters_see_whole_model_names() -> None:
    """A block decides as the whole-model call would: int8 keeps modulation dense by name."""
    model = Tiny()
    model.blocks[0].add_module("norm1_linear", torch.nn.Linear(512, 512))
    # "embed" as a family's int8_dense_modules token (no longer a generic one:
    # a context embedder is quantised), honoured outside the blocks too.
    keep = quantize.module_filter("int8", ("embed",))
    placement = quantize_on_host_then_place(model, "int8", "cpu", keep=keep)
    assert not is_quantised(model.blocks[0].norm1_linear.weight) and not is_quantised(model.embed.weight)
    assert is_quantised(model.blocks[0][0].weight) and is_quantised(model.proj_out.weight)
    assert placement.layers == 4 and placement.site == "host"


def test_placing_turns_any_placement_error_into_a_typed_one() -> None:
    with pytest.raises(PlacementFailed) as raised:
        with placing("the pipeline (model_offload)", "cuda"):
            raise torch.OutOfMemoryError(OOM)
    assert raised.value.out_of_memory and "the pipeline (model_offload) to cuda" in raised.value.message
    with pytest.raises(PlacementFailed) as other:
        with placing("the pipeline (group_offload)", "cuda"):
            raise RuntimeError("Expected all tensors to be on the same device")
    assert not other.value.out_of_memory and "same device" in other.value.message


# -- training ------------------------------------------------------------------


@pytest.fixture
def int8_plan(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> Iterator[Any]:
    data = write_dataset(tmp_path / "data", count=2, size=64)
    config = TrainingConfig.from_data({
        "base_model": str(tiny_pipeline("flux")), "dataset_dir": str(data), "resolution": 64,
        "steps": 2, "lora_rank": 4, "learning_rate": 1e-3, "device": "cpu", "base_precision": "int8",
    })
    yield preflight_training(REGISTRY, config, HARDWARE)


@pytest.mark.slow
def test_trainer_quantises_the_int8_base_on_the_host_before_moving_it(
    int8_plan: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.training.precision import int8_training_filter

    at_first_move: list[tuple[int, int]] = []
    real_move = quantize.move_to

    def move_to(module: Any, device: str, what: str) -> None:
        if not at_first_move and isinstance(module, torch.nn.Module):
            layers = quantisable(module, int8_training_filter)
            at_first_move.append((len(layers), sum(is_quantised(m.weight) for m in layers)))
        real_move(module, device, what)

    monkeypatch.setattr(quantize, "move_to", move_to)
    events: list[dict[str, object]] = []
    result = run_training(int8_plan, tmp_path / "out", events.append, lambda: None)
    assert result["type"] == "completed"
    [(layers, quantised)] = at_first_move
    assert layers > 0 and quantised == layers, "every int8 layer was quantised before the first move"
    placing_event = next(e for e in events if e.get("phase") == "placing")
    assert "quantised int8 on the host, block by block" in str(placing_event["message"])
    started = next(e for e in events if e["type"] == "started")
    placement = started["base_placement"]
    assert placement["site"] == "host" and placement["blocks"] > 0  # type: ignore[index]
    assert started["quantised_layers"] == layers
    losses = [float(e["loss"]) for e in events if e["type"] == "progress"]  # type: ignore[arg-type]
    assert len(losses) == 2 and np.isfinite(losses).all()


@pytest.mark.slow
def test_an_oom_moving_the_training_base_is_a_typed_error(
    int8_plan: Any, tmp_path: Path, oom_once: list[str]
) -> None:
    with pytest.raises(PlacementFailed) as raised:
        run_training(int8_plan, tmp_path / "out", lambda e: None, lambda: None)
    assert raised.value.code == "placement_failed" and OOM in raised.value.message


def test_mxfp8_training_conversion_runs_with_the_installed_torchao() -> None:
    """torchao renamed ``MXLinearConfig``; the conversion must still find its config.
    (The MX GEMMs need sm100; the conversion itself runs anywhere.)"""
    from engine.training.precision import apply_base_precision

    block = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.Linear(512, 512)).requires_grad_(False)
    assert apply_base_precision(block.to(torch.bfloat16), "mxfp8") == 1  # the biased Linear stays
    first, second = block
    assert is_quantised(first.weight) or type(first).__name__ != "Linear"
    assert not is_quantised(second.weight) and type(second).__name__ == "Linear"
