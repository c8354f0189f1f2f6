"""Quantised sizes a family can trust: factors derived from a checkpoint's headers with the
engine's own filter agree with what the runtime's int8 build really holds, for a denoiser whose
weights are largely Conv2d (Sana's feed-forward) where the generic factor is far off; and the
built-in tables' factors agree with the ones derived from their full-size configs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine.contract.plugins import load_registry
from engine.contract.types import QuantRules
from engine.policy.schemes import SCHEME_SIZES
from engine.testing.quant_factors import (
    TOLERANCE,
    checkpoint_shapes,
    factors_of,
    full_size_shapes,
    main,
    table_problems,
)

REGISTRY = load_registry()


@pytest.fixture(scope="module")
def sana_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Sana transformer at 512 wide, two layers, saved as a pipeline folder's denoiser: its
    GLUMBConv feed-forward is Conv2d (4-D weights the filter keeps dense), as in Sana 1.6B."""
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(0)
    model = SanaTransformer2DModel(
        in_channels=32, out_channels=32, num_attention_heads=16, attention_head_dim=32, num_layers=2,
        num_cross_attention_heads=16, cross_attention_head_dim=32, cross_attention_dim=512, caption_channels=512,
        sample_size=8,
    ).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("sana-like") / "sana-like"
    model.save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "SanaPipeline",
                                                         "transformer": ["diffusers", "SanaTransformer2DModel"]}))
    return folder


def test_header_factors_of_a_conv2d_heavy_denoiser_match_the_runtime_int8_build(sana_like: Path) -> None:
    from diffusers import SanaTransformer2DModel

    from engine.runtime.quantize import quantize_transformer, storage_bytes

    shapes = checkpoint_shapes(sana_like)
    conv = sum(torch.Size(s).numel() for n, s in shapes if len(s) == 4)
    assert conv / sum(torch.Size(s).numel() for _, s in shapes) > 0.3, "a Conv2d-heavy denoiser, as Sana's"
    derived = factors_of(shapes)
    model = SanaTransformer2DModel.from_pretrained(sana_like / "transformer", torch_dtype=torch.bfloat16)
    quantize_transformer(model, "int8", "cpu")
    measured_gb = storage_bytes(model) / 1e9
    predicted_gb = derived.factors["int8"] * derived.dense_gb
    assert abs(predicted_gb - measured_gb) / measured_gb < TOLERANCE, (predicted_gb, measured_gb)
    # The generic factor assumes every weight quantises: it takes this denoiser for far lighter.
    generic_gb = SCHEME_SIZES["int8"].steady * derived.dense_gb
    assert generic_gb < 0.85 * measured_gb
    # The engine's own sizing of the folder (the plan's preflight) says what the tool says.
    from engine.preflight.folder import pipeline_source

    # Read as a family whose denoiser is a ``transformer`` folder (Sana is no built-in family).
    source_gb = pipeline_source(REGISTRY, sana_like, REGISTRY.family("flux")).scheme_gb["int8"]  # type: ignore[index]
    assert abs(source_gb - predicted_gb) / predicted_gb < TOLERANCE


def test_the_tool_flags_the_generic_factor_and_a_wrong_table_and_prints_the_fields(
        sana_like: Path, capsys: pytest.CaptureFixture[str]) -> None:
    derived = factors_of(checkpoint_shapes(sana_like))
    bare = dataclasses.replace(REGISTRY.family("flux"), quantisation=QuantRules())
    [generic] = [p for p in table_problems(bare, derived) if "int8 takes the generic" in p and "factors=" in p]
    assert f"declare QuantRules(factors={{'int8': {derived.factors['int8']:.3f}}})" in generic
    fixed = dataclasses.replace(bare, quantisation=QuantRules(factors=tuple(derived.factors.items())))
    assert table_problems(fixed, derived) == []
    assert main([str(sana_like), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["factors"] == derived.factors and printed["dense_gb"] == pytest.approx(derived.dense_gb)


@pytest.mark.parametrize("family", ["flux", "qwen_image", "zimage", "sdxl", "wan", "sd3"])
def test_each_built_in_tables_factors_hold_against_its_full_size_headers(family: str) -> None:
    """Full size on the meta device (no weights): the factors each table declares, and the
    generic ones it leaves, are what the filter gives (within 2%; generic ones only too heavy)."""
    spec = REGISTRY.family(family)
    derived = factors_of(full_size_shapes(spec), spec.quantisation.int8_dense_modules)
    assert table_problems(spec, derived) == []
    off = dataclasses.replace(spec, quantisation=dataclasses.replace(spec.quantisation, factors=(("int8", 0.9),)))
    assert any("factors[int8] is 0.9" in p for p in table_problems(off, derived))
