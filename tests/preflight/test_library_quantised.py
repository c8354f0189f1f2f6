"""Pipeline folders whose denoiser another library stored quantised, named from the
``quant_method`` of its config: SDNQ (read through the ``sdnq`` package on any device), Nunchaku
Lite's SVDQuant (Nunchaku's CUDA kernels: Turing to Blackwell, never Hopper; nvfp4 on
Blackwell), bitsandbytes nf4. A scheme this machine cannot compute, a library that is not
installed, or a method the engine does not read is refused before anything is evicted."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.errors import PreflightError


def _with_config(base: Path, target: Path, quantization_config: dict) -> Path:
    """``base`` copied with its denoiser's config naming ``quantization_config`` (weights as they are)."""
    shutil.copytree(base, target)
    config_file = target / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return target


@pytest.fixture(scope="module")
def sdnq_folder(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.1 with its transformer quantised int8 by diffusers' SDNQ quantizer and saved."""
    import diffusers
    import torch

    base = tiny_pipeline("flux")
    folder = tmp_path_factory.mktemp("sdnq") / "flux-sdnq-int8"
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns("transformer"))
    model = diffusers.FluxTransformer2DModel.from_pretrained(
        str(base), subfolder="transformer", quantization_config=diffusers.SDNQConfig(weights_dtype="int8"),
        dtype=torch.float32)
    model.save_pretrained(str(folder / "transformer"))
    return folder


def test_an_sdnq_folder_is_named_from_its_config_and_planned_as_stored(
    engine_registry: Registry, sdnq_folder: Path,
) -> None:
    from engine.hardware.presets import PRESETS
    from engine.policy.inference import plan_inference
    from engine.preflight.model import resolve_model
    from engine.requests.inference import InferenceRequest

    source = resolve_model(engine_registry, sdnq_folder)
    assert source.prequantised_scheme == "sdnq"
    facts = source.facts(engine_registry)
    for card in ("cpu", "rtx4090", "h100"):
        plan = plan_inference(engine_registry, facts, PRESETS[card], InferenceRequest(), env={})
        assert plan.value("transformer_quant") == "sdnq", card
    with pytest.raises(PreflightError) as refused:
        plan_inference(engine_registry, facts, PRESETS["cpu"], InferenceRequest(quant="int8"), env={})
    assert refused.value.code == "prequantised_model"


@pytest.mark.slow
def test_on_the_cpu_an_sdnq_folder_renders_through_its_own_layers(
    engine_registry: Registry, sdnq_folder: Path, tiny_pipeline: Callable[[str], Path],
) -> None:
    """Its Linears are SDNQ's (int8 codes and scales in memory, nothing requantised at load); the
    image is the dense model's within int8's rounding, and not the dense image itself."""
    from engine.service.facade import Engine

    asked, images = {"width": 64, "height": 64, "steps": 2, "seed": 3}, {}
    with Engine(registry=engine_registry) as engine:
        for name, model in (("sdnq", sdnq_folder), ("dense", tiny_pipeline("flux"))):
            status = engine.images.load(str(model))
            if name == "sdnq":
                layer = engine.images.session.pipeline.transformer.transformer_blocks[0].attn.to_q  # type: ignore[union-attr]
                assert type(layer).__name__ == "SDNQLinear" and str(layer.weight.dtype) == "torch.int8"
                assert status["quantised_layers"] == 0
            images[name] = np.asarray(engine.images.generate("a red fox", **asked)[0]).astype(int)
    drift = np.abs(images["sdnq"] - images["dense"])
    assert 0 < drift.mean() < 8


@pytest.mark.parametrize(("card", "precision", "why"), [
    ("h100", "int4", "not Hopper"), ("t4", "int4", None), ("rtx4090", "int4", None), ("v100", "int4", "Turing"),
    ("cpu", "int4", "NVIDIA GPU"), ("rtx4090", "nvfp4", "Blackwell"), ("b200", "nvfp4", None),
])
def test_svdquant_runs_where_nunchakus_kernels_do(card: str, precision: str, why: str | None) -> None:
    from engine.hardware.presets import PRESETS
    from engine.policy.quant import scheme_unsupported_reason

    scheme = "svdquant_nvfp4" if precision == "nvfp4" else "svdquant"
    reason = scheme_unsupported_reason(scheme, PRESETS[card])
    assert (reason is None) == (why is None) and (why is None or why in str(reason)), reason


@pytest.mark.parametrize(("config", "code", "named"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
     "stored_scheme_unsupported", "stored pre-quantised as nf4, which this machine cannot compute"),
    ({"quant_method": "quanto", "weights": "int8"}, "unsupported_format", "stores the model as 'quanto'"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "unsupported_format", "bitsandbytes 8-bit"),
    ({"quant_method": "nunchaku_lite", "svdq_w4a4": {"precision": "int4", "group_size": 64, "rank": 32,
                                                     "targets": ["transformer_blocks.0.attn.to_q"]}},
     "stored_scheme_unsupported", "stored pre-quantised as svdquant, which this machine cannot compute (svdquant "
                                  "needs Nunchaku's CUDA kernels"),
], ids=["nf4-on-the-cpu", "unknown-method", "bnb-8-bit", "svdquant-on-the-cpu"])
def test_a_stored_folder_that_cannot_load_here_is_refused_before_eviction(
    engine_registry: Registry, tiny_pipeline: Callable[[str], Path], tmp_path: Path, config: dict, code: str,
    named: str,
) -> None:
    from engine.hardware.probe import probe
    from engine.testing.checkpoints import refused_beside_resident

    assert probe(verify=False).vendor == "cpu", "the nf4 and svdquant rows need a machine without an NVIDIA GPU"
    base = tiny_pipeline("flux")
    folder = _with_config(base, tmp_path / "flux-stored", config)
    error = refused_beside_resident(engine_registry, base, folder)
    assert error.code == code and named in error.message, error.message  # type: ignore[attr-defined]
