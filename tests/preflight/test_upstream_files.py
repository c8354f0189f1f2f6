"""Single files their publishers stored quantised: ComfyUI's ``fp8_scaled`` told from its header,
every scale checked before anything is evicted, kept fp8 where the card computes it and
dequantised (said in the plan) where it does not, rendered on the CPU as the dense model it
encodes; quantised layouts the engine does not read are refused naming a tensor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.errors import PreflightError


@pytest.fixture(scope="module")
def files(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The tiny FLUX.1 base, its transformer as an fp8_scaled file, and as the dense file it encodes."""
    from engine.testing.checkpoints import write_fp8_scaled

    base = tiny_pipeline("flux")
    root = tmp_path_factory.mktemp("fp8-scaled")
    scaled = write_fp8_scaled(base, "transformer", root / "flux1-dev-fp8_scaled.safetensors", dense=root / "dense" / "flux1-dev.safetensors")
    return base, scaled, root / "dense" / "flux1-dev.safetensors"


def _resaved(source: Path, target: Path, change: Callable[[dict], dict]) -> Path:
    from safetensors.torch import load_file, save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(change(load_file(str(source))), str(target))
    return target


def test_an_fp8_scaled_file_is_named_from_its_header_and_sized_as_the_model_it_encodes(
    engine_registry: Registry, files: tuple[Path, Path, Path],
) -> None:
    from engine.preflight.model import resolve_model

    base, scaled, dense = files
    source, plain = resolve_model(engine_registry, scaled, base=base), resolve_model(engine_registry, dense, base=base)
    assert (source.kind, source.upstream_format, plain.upstream_format) == ("single_file", "fp8_scaled", None)
    assert source.measured_sizes == plain.measured_sizes  # the scales and the marker are not the model's


@pytest.mark.parametrize(("card", "kept"), [("rtx4090", True), ("h100", True), ("a100-80g", False), ("cpu", False)])
def test_the_plan_keeps_it_fp8_where_the_card_computes_fp8_and_dequantises_it_elsewhere(
    engine_registry: Registry, files: tuple[Path, Path, Path], card: str, kept: bool,
) -> None:
    from engine.hardware.presets import PRESETS
    from engine.policy.inference import plan_inference
    from engine.preflight.model import resolve_model
    from engine.requests.inference import InferenceRequest

    base, scaled, _ = files
    facts = resolve_model(engine_registry, scaled, base=base).facts(engine_registry)
    plan = plan_inference(engine_registry, facts, PRESETS[card], InferenceRequest(), env={})
    reason = plan["transformer_quant"].reason
    if kept:
        assert plan.value("transformer_quant") == "fp8" and "stored fp8_scaled" in reason and "kept fp8" in reason
    else:
        assert plan.value("transformer_quant") is None and "dequantised to" in reason, reason
    with pytest.raises(PreflightError) as refused:  # another scheme is never laid over it
        plan_inference(engine_registry, facts, PRESETS[card], InferenceRequest(quant="int8"), env={})
    assert refused.value.code == "prequantised_model" and "fp8_scaled" in refused.value.message


@pytest.mark.slow
def test_on_the_cpu_it_renders_the_dense_model_it_encodes(
    engine_registry: Registry, files: tuple[Path, Path, Path],
) -> None:
    """Dequantised on load (the CPU computes no fp8): the image of the dense file holding the
    same values, pixel for pixel; beside the original bf16-exact model, within fp8's rounding."""
    from engine.service.facade import Engine

    base, scaled, dense = files
    asked = {"width": 64, "height": 64, "steps": 2, "seed": 3}
    images = {}
    with Engine(registry=engine_registry) as engine:
        for name, model, given in (("scaled", scaled, base), ("dense", dense, base), ("original", base, None)):
            engine.images.load(str(model), base=str(given) if given else None)
            images[name] = np.asarray(engine.images.generate("a red fox", **asked)[0]).astype(int)
    assert np.array_equal(images["scaled"], images["dense"])
    assert np.abs(images["scaled"] - images["original"]).mean() < 8


@pytest.mark.parametrize(("change", "named"), [
    (lambda s: {k: v for k, v in s.items() if k != "transformer_blocks.0.attn.to_q.scale_weight"},
     "transformer_blocks.0.attn.to_q.weight is stored fp8_scaled but transformer_blocks.0.attn.to_q.scale_weight is missing"),
    (lambda s: {**s, "transformer_blocks.0.attn.to_q.scale_weight": s["transformer_blocks.0.attn.to_q.scale_weight"]
                .repeat(3)}, "transformer_blocks.0.attn.to_q.scale_weight is F32 [3], which does not scale"),
], ids=["scale-missing", "scale-mismatched"])
def test_a_scale_missing_or_mismatched_is_refused_naming_the_tensor_before_anything_is_evicted(
    engine_registry: Registry, files: tuple[Path, Path, Path], tmp_path: Path, change: Callable[[dict], dict],
    named: str,
) -> None:
    from engine.testing.checkpoints import refused_beside_resident

    base, scaled, _ = files
    broken = _resaved(scaled, tmp_path / "flux1-dev-fp8_scaled.safetensors", change)
    error = refused_beside_resident(engine_registry, base, broken)
    assert error.code == "corrupt_checkpoint" and named in error.message, error.message  # type: ignore[attr-defined]


def test_a_layout_of_int8_codes_the_engine_does_not_read_is_refused_naming_a_tensor(
    engine_registry: Registry, files: tuple[Path, Path, Path], tmp_path: Path,
) -> None:
    """int8 codes (a ConvRot-style file): refused, never loaded as if its codes were weights."""
    import torch

    from engine.preflight.model import resolve_model

    base, _, dense = files

    def int8(state: dict) -> dict:
        weight = state["transformer_blocks.0.attn.to_q.weight"]
        return {**state, "transformer_blocks.0.attn.to_q.weight": weight.clamp(-1, 1).mul(127).to(torch.int8)}

    packed = _resaved(dense, tmp_path / "flux1-dev-int8_convrot.safetensors", int8)
    with pytest.raises(PreflightError) as refused:
        resolve_model(engine_registry, packed, base=base)
    assert refused.value.code == "unsupported_format"
    assert "transformer_blocks.0.attn.to_q.weight is I8" in refused.value.message


def test_a_plain_fp8_cast_is_named_and_loads_its_codes_as_values(
    engine_registry: Registry, files: tuple[Path, Path, Path], tmp_path: Path,
) -> None:
    """float8 weights with no scale beside them (a plain cast, each scale 1): named
    ``fp8_e4m3fn`` and read back as their values."""
    import torch

    from engine.preflight.model import resolve_model
    from engine.runtime.upstream_files import dequantised, stored_format

    base, _, dense = files

    def cast(state: dict) -> dict:
        return {k: v.to(torch.float8_e4m3fn) if "blocks" in k and v.ndim == 2 else v for k, v in state.items()}

    file = _resaved(dense, tmp_path / "flux1-dev-fp8_e4m3fn.safetensors", cast)
    assert resolve_model(engine_registry, file, base=base).upstream_format == "fp8_e4m3fn"
    from safetensors.torch import load_file

    key = "transformer_blocks.0.attn.to_q.weight"
    weight, codes = dequantised(file, torch.float32, stored_format(file))[key], load_file(str(file))[key]
    assert codes.dtype == torch.float8_e4m3fn and weight.dtype == torch.float32
    assert torch.equal(weight, codes.float())
