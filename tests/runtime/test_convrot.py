"""ConvRot int8 as a scheme: each Linear's weight stored rotated by a block-diagonal regular
Hadamard and its inputs rotated as they arrive (the same product), then int8 through torchao;
asked at load (``--quant int8_convrot``) or stored once by ``quantize``, whose folder loads as
stored and renders what quantising at load renders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.contract.plugins import load_registry
from engine.hardware.probe import probe
from engine.requests.inference import InferenceRequest
from engine.runtime.convrot import ROTATED, group_for, regular_hadamard, rotate_linears, rotated
from engine.service.facade import Engine

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
ASKED = {"width": 64, "height": 64, "steps": 2, "seed": 3}


@pytest.mark.parametrize("size", [4, 16, 64, 256])
def test_the_regular_hadamard_is_symmetric_orthogonal_and_its_own_inverse(size: int) -> None:
    matrix = regular_hadamard(size)
    assert torch.equal(matrix, matrix.T)
    assert torch.allclose(matrix @ matrix, torch.eye(size), atol=1e-6)
    values = torch.randn(3, 2 * size)
    assert torch.allclose(rotated(rotated(values, size), size), values, atol=1e-5)
    with pytest.raises(ValueError):
        regular_hadamard(size * 2)  # not a power of 4


def test_a_rotated_linear_computes_the_same_product() -> None:
    """Weight stored rotated, inputs rotated on arrival: the output of the original Linear; a
    Linear no group divides is left alone."""
    layers = torch.nn.Sequential(torch.nn.Linear(512, 64), torch.nn.Linear(64, 40), torch.nn.Linear(40, 8))
    inputs = torch.randn(5, 512)
    expected = layers(inputs)
    original = layers[0].weight.detach().clone()
    assert rotate_linears(layers, lambda module, name: True) == 2
    assert getattr(layers[0], ROTATED) == group_for(512) == 256 and getattr(layers[1], ROTATED) == 64
    assert not hasattr(layers[2], ROTATED)
    assert not torch.allclose(layers[0].weight, original)
    assert torch.allclose(layers(inputs), expected, atol=1e-5)


@pytest.fixture(scope="module")
def images(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The tiny FLUX.1 rendered dense, int8 and int8_convrot at load, and from a stored
    int8_convrot folder (with the load statuses and the folder)."""
    base = tiny_pipeline("flux")
    folder = tmp_path_factory.mktemp("convrot") / "flux-int8_convrot"
    found: dict[str, object] = {}
    with Engine(registry=REGISTRY, hardware=HARDWARE) as engine:
        for scheme in ("none", "int8", "int8_convrot"):
            found[f"{scheme}-status"] = engine.images.load(str(base), request=InferenceRequest(quant=scheme))
            if scheme == "int8_convrot":
                layer = engine.images.session.pipeline.transformer.transformer_blocks[0].attn.to_q  # type: ignore[union-attr]
                found["rotated"] = (getattr(layer, ROTATED, 0), type(layer.weight.data).__name__)
            found[scheme] = np.asarray(engine.images.generate("a red fox", **ASKED)[0]).astype(int)
        engine.images.unload()
        found["written"] = engine.quantize(str(base), "int8_convrot", folder)
        found["stored-status"] = engine.images.load(str(folder))
        found["stored"] = np.asarray(engine.images.generate("a red fox", **ASKED)[0]).astype(int)
    return found


@pytest.mark.slow
def test_at_load_its_linears_are_stored_rotated_int8_and_the_image_stays_within_int8s_drift(
    images: dict[str, object],
) -> None:
    status = images["int8_convrot-status"]
    assert status["plan"]["resolved"]["transformer_quant"]["value"] == "int8_convrot"  # type: ignore[index]
    assert status["quantised_layers"] == images["int8-status"]["quantised_layers"] > 0  # type: ignore[index]
    assert images["rotated"] == (256, "Int8Tensor")
    dense, int8, convrot = (images[k] for k in ("none", "int8", "int8_convrot"))
    # bench/scheme_drift.py: both about a level or less on the tiny model's outlier-free weights
    assert np.abs(convrot - dense).mean() < 1.5 and np.abs(int8 - dense).mean() < 1.5  # type: ignore[operator]
    assert not np.array_equal(convrot, int8)  # another scheme, not int8 under a new name


@pytest.mark.slow
def test_a_quantize_folder_loads_as_stored_and_renders_what_quantising_at_load_renders(
    images: dict[str, object],
) -> None:
    written, status = images["written"], images["stored-status"]
    assert written["scheme"] == "int8_convrot" and written["layers"] > 0  # type: ignore[index]
    quant = status["plan"]["resolved"]["transformer_quant"]  # type: ignore[index]
    assert (quant["value"], quant["reason"]) == ("int8_convrot", "the checkpoint is stored pre-quantised")
    assert status["quantised_layers"] == 0  # type: ignore[index]
    assert np.array_equal(images["stored"], images["int8_convrot"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("card", "why"), [("t4", "needs sm80+"), ("apple-m3-max", "not supported on Apple MPS")])
def test_where_torchao_int8_cannot_run_it_falls_back_to_dense_saying_why(
    tiny_pipeline: Callable[[str], Path], card: str, why: str,
) -> None:
    from engine.hardware.presets import PRESETS
    from engine.policy.inference import plan_inference
    from engine.preflight.model import resolve_model

    facts = resolve_model(REGISTRY, tiny_pipeline("flux")).facts(REGISTRY)
    plan = plan_inference(REGISTRY, facts, PRESETS[card], InferenceRequest(quant="int8_convrot"), env={})
    reason = plan["transformer_quant"].reason
    assert plan.value("transformer_quant") is None and why in reason and "int8_convrot" in reason, reason
