"""Precision per component: a family whose text encoder alone is fp16-unsafe (Sana's Gemma-2)
computes its denoiser in fp16 with the encoder in bf16 or fp32, each with its reason, and the
memory plan counts the encoder at its own width; an fp16-unsafe denoiser is still refused fp16.
The runtime loads each component in its planned dtype and the pipeline runs across them."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.contract.hookspecs import hookimpl
from engine.contract.plugins import BLOCK_ENV, Registry, load_registry
from engine.contract.types import FamilySpec, PrecisionRules
from engine.errors import PreflightError
from engine.hardware.presets import preset
from engine.policy.inference import ModelFacts, plan_inference
from engine.requests.inference import InferenceRequest

ENCODER = "its Gemma-2 text encoder overflows to inf in fp16"


def with_unsafe_encoders(family: str) -> Registry:
    """The installed registry with ``family``'s table saying its text encoders are fp16-unsafe
    (its own plugin stepped aside, the changed table registered in its place)."""
    spec = load_registry().family(family)
    changed = dataclasses.replace(spec, precision=PrecisionRules(fp16_unsafe=(("text_encoders", ENCODER),)))
    plugin = types.ModuleType(f"unsafe_{family}")
    plugin.ENGINE_PLUGIN_API = 1  # type: ignore[attr-defined]

    @hookimpl
    def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
        register(changed)

    plugin.engine_register_families = engine_register_families  # type: ignore[attr-defined]
    return load_registry(plugins=[(f"unsafe_{family}", plugin)], env={BLOCK_ENV: family})


def plan_for(registry: Registry, family: str, hardware: str, **request: object):  # type: ignore[no-untyped-def]
    spec = registry.family(family)
    facts = ModelFacts(spec, spec.default_checkpoint, registry.component_sizes(spec, spec.default_checkpoint))
    return plan_inference(registry, facts, preset(hardware), InferenceRequest(**request))  # type: ignore[arg-type]


def test_a_t4_plans_an_fp16_denoiser_beside_fp32_encoders_and_counts_them_at_fp32() -> None:
    unsafe, stock = with_unsafe_encoders("sdxl"), load_registry()
    plan = plan_for(unsafe, "sdxl", "t4")
    assert plan.value("dtype") == "fp16" and "its text encoders in fp32" in plan["dtype"].reason
    assert plan.value("text_encoder_dtype") == "fp32" and ENCODER in plan["text_encoder_dtype"].reason
    assert plan.value("vae_dtype") == "fp16"
    before = plan_for(stock, "sdxl", "t4")
    assert before.value("dtype") == "fp16" and before.value("text_encoder_dtype") == "fp16"
    encoders = stock.component_sizes(stock.family("sdxl"), None).text_encoders_gb
    grown = plan.estimate.components.text_encoders_gb - before.estimate.components.text_encoders_gb
    assert grown == pytest.approx(encoders, rel=0.01), "the encoders are counted at fp32: twice their bf16 size"


def test_an_fp16_request_on_a_bf16_card_keeps_the_unsafe_encoders_in_bf16() -> None:
    plan = plan_for(with_unsafe_encoders("sdxl"), "sdxl", "rtx4090", dtype="fp16")
    assert plan.value("dtype") == "fp16" and plan["dtype"].source == "explicit"
    assert plan.value("text_encoder_dtype") == "bf16" and "fp16 is unsafe for its text encoders" in \
        plan["text_encoder_dtype"].reason
    assert plan.to_dict()["resolved"]["text_encoder_dtype"]["value"] == "bf16"  # type: ignore[index]
    # Without an fp16 denoiser nothing changes: a bf16 plan runs every component in bf16.
    auto = plan_for(with_unsafe_encoders("sdxl"), "sdxl", "rtx4090")
    assert {auto.value(c) for c in ("dtype", "text_encoder_dtype", "vae_dtype")} == {"bf16"}


def test_an_fp16_unsafe_denoiser_is_still_refused_fp16_and_takes_fp32_on_a_t4() -> None:
    registry = load_registry()
    with pytest.raises(PreflightError) as refused:
        plan_for(registry, "zimage", "rtx4090", dtype="fp16")
    assert refused.value.code == "fp16_unsafe" and "attention" in refused.value.message
    with pytest.raises(PreflightError) as nowhere:  # Z-Image's fp32 transformer (24.6 GB) fits no T4 plan
        plan_for(registry, "zimage", "t4")
    assert nowhere.value.code in ("no_safe_dtype", "insufficient_memory")


def test_the_runtime_loads_each_component_in_its_planned_dtype_and_generates(
        tiny_pipeline: Callable[[str], Path]) -> None:
    """On the CPU, fp16 asked of a tiny SDXL whose encoders are fp16-unsafe: the UNet and VAE
    load in fp16, both text encoders in bf16 (the CPU's safe width); the encoders' output is
    cast into the UNet as it enters, and the image is finite and not flat."""
    import numpy as np
    import torch

    from engine.hardware.probe import probe
    from engine.service.facade import Engine

    engine = Engine(registry=with_unsafe_encoders("sdxl"), hardware=probe(verify=False))
    engine.images.load(str(tiny_pipeline("sdxl")), request=InferenceRequest(dtype="fp16"))
    try:
        pipe = engine.images.session._pipe  # type: ignore[union-attr]  # noqa: SLF001
        assert (pipe.unet.dtype, pipe.vae.dtype) == (torch.float16, torch.float16)
        assert (pipe.text_encoder.dtype, pipe.text_encoder_2.dtype) == (torch.bfloat16, torch.bfloat16)
        plan = engine.images.loaded_plan()
        assert plan is not None and plan.value("text_encoder_dtype") == "bf16"
        [image] = engine.images.generate("a red fox", steps=2, width=64, height=64, seed=1)
        pixels = np.asarray(image, dtype=np.float32)
        assert np.isfinite(pixels).all() and pixels.std() > 1.0
    finally:
        engine.images.unload()
