"""Real generation on CPU with tiny pipelines of every family's real architecture."""

from __future__ import annotations

from tests.support import session_for, pixels, SIZE

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, Plan, plan_inference
from engine.policy.resolved import explicit
from engine.preflight.model import resolve_model
from engine.runtime import flags
from engine.runtime.session import GenerateRequest, InferenceSession
from engine.testing.checkpoints import write_gguf, write_single_file

REGISTRY = load_registry()
HARDWARE = probe(verify=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux", "qwen_image", "zimage", "sdxl"])
def test_each_family_generates_the_asked_size_deterministically(
    family: str, tiny_pipeline: Callable[[str], Path]
) -> None:
    size = {"width": 64, "height": 64} if family == "sdxl" else SIZE
    session = session_for(tiny_pipeline(family))
    session.load()
    try:
        first = pixels(session, seed=7, **size)
        again = pixels(session, seed=7, **size)
        other = pixels(session, seed=8, **size)
    finally:
        session.unload()
    assert first.shape == (size["height"], size["width"], 3)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


@pytest.mark.slow
def test_torchao_int8_is_applied_and_generates(tiny_pipeline: Callable[[str], Path]) -> None:
    folder = tiny_pipeline("flux")
    dense = session_for(folder, InferenceRequest(quant="none"))
    dense.load()
    reference = pixels(dense)
    dense.unload()
    session = session_for(folder, InferenceRequest(quant="int8"))
    session.load()
    try:
        assert session.plan.value("transformer_quant") == "int8"
        assert session.quantised_layers > 0
        quantised = [
            name for name, m in session.denoiser.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m.weight) is not torch.nn.Parameter
        ]
        assert len(quantised) == session.quantised_layers
        assert not any("norm" in n or "embed" in n for n in quantised)  # the int8 filter
        image = pixels(session)
    finally:
        session.unload()
    assert image.shape == reference.shape and np.isfinite(image).all()
    assert 0 < np.abs(image.astype(int) - reference.astype(int)).mean() < 20


@pytest.mark.slow
def test_gguf_transformer_loads_through_diffusers_and_generates(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    from diffusers.quantizers.gguf.utils import GGUFParameter

    base = tiny_pipeline("flux")
    file = write_gguf(base, "transformer", tmp_path / "tiny-flux-Q8_0.gguf")
    session = session_for(file, base=base)
    session.load()
    try:
        assert session.source.kind == "gguf"
        assert any(isinstance(p, GGUFParameter) for p in session.denoiser.parameters())
        assert pixels(session).shape == (48, 64, 3)
    finally:
        session.unload()


@pytest.mark.slow
def test_single_file_folder_loads_and_matches_the_pipeline(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_pipeline("zimage")
    write_single_file(base, "transformer", tmp_path / "zimage-single" / "z.safetensors")
    whole, single = session_for(base), session_for(tmp_path / "zimage-single", base=base)
    whole.load()
    single.load()
    try:
        assert single.source.kind == "single_file"
        assert np.array_equal(pixels(whole), pixels(single))
    finally:
        whole.unload()
        single.unload()


@pytest.mark.slow
def test_first_block_cache_toggles_across_calls_and_provenance_follows(
    tiny_pipeline: Callable[[str], Path],
) -> None:
    session = session_for(tiny_pipeline("flux"), InferenceRequest(speed="default"))
    session.load()
    try:
        seen = []
        for steps in (28, 4, 28):
            pixels(session, steps=steps)
            record = session.status()["plan"]["resolved"]["step_cache"]  # type: ignore[index]
            seen.append((session.denoiser.is_cache_enabled, record["value"], record["source"]))
            assert str(steps) in record["reason"]
    finally:
        session.unload()
    assert seen == [(True, "fbcache", "auto"), (False, "off", "auto"), (True, "fbcache", "auto")]


@pytest.mark.slow
def test_pinned_step_cache_is_never_toggled(tiny_pipeline: Callable[[str], Path]) -> None:
    session = session_for(tiny_pipeline("qwen_image"), InferenceRequest(step_cache="fbcache"))
    session.load()
    try:
        for steps in (2, 28):
            pixels(session, steps=steps)
            assert session.denoiser.is_cache_enabled
            assert session.plan["step_cache"].source == "explicit"
    finally:
        session.unload()


@pytest.mark.slow
def test_every_flag_the_load_changed_is_back_after_unload(tiny_pipeline: Callable[[str], Path]) -> None:
    before = flags.snapshot().values
    wanted = 1 if before["threads"] != 1 else 2
    session = session_for(tiny_pipeline("sdxl"), InferenceRequest(threads=wanted))
    session.load()
    assert torch.get_num_threads() == wanted  # the load did change a flag
    pixels(session, width=64, height=64)
    session.unload()
    assert flags.snapshot().values == before


@pytest.mark.slow
def test_unload_releases_the_pipeline(tiny_pipeline: Callable[[str], Path]) -> None:
    session = session_for(tiny_pipeline("zimage"))
    session.load()
    ref = weakref.ref(session.pipeline)
    session.unload()
    gc.collect()
    assert ref() is None
    with pytest.raises(EngineError) as raised:
        _ = session.pipeline
    assert raised.value.code == "not_loaded"


def test_the_libraries_are_frozen_before_the_first_build_and_an_unload_still_frees_a_cyclic_model(
    tiny_pipeline: Callable[[str], Path],
) -> None:
    """The load freezes what exists before it builds (torch's, diffusers' objects: out of every
    later collection's walk), never the model: a pipeline caught in a reference cycle, as hooks
    make one, is freed by the unload's own collection, with no collection of the test's."""
    session = session_for(tiny_pipeline("zimage"))
    session.load()
    assert gc.get_freeze_count() > 50_000  # torch and diffusers imported: their objects frozen
    pipeline = session.pipeline
    pipeline.transformer._back_to_the_pipeline = pipeline  # a cycle: refcounts alone never free it
    ref = weakref.ref(pipeline.transformer)
    del pipeline
    session.unload()
    assert ref() is None, "the unload's collection left the model: it was frozen with the libraries"


def _with_quant_that_fails(plan: Plan) -> Plan:
    """This CPU plan, but asking for mxfp8, whose torchao build fails on CPU."""
    failing = plan.with_control("transformer_quant", explicit("mxfp8"))
    return dataclasses.replace(failing, fallback=plan)


@pytest.mark.slow
def test_a_failed_quantised_build_loads_the_fallback_and_says_why(tiny_pipeline: Callable[[str], Path]) -> None:
    session = session_for(tiny_pipeline("flux"), InferenceRequest(quant="none"))
    session.plan = _with_quant_that_fails(session.plan)
    session.load()
    try:
        quant = session.plan["transformer_quant"]
        # in fp32 torchao refuses to quantise mxfp8 on a CPU; in bf16 it quantises, and the canary's
        # forward raises: either way the dense fallback loads, saying why
        assert quant.value is None and ("mxfp8 quantisation failed" in quant.reason
                                        or "the mxfp8 canary could not run" in quant.reason), quant.reason
        assert pixels(session).shape == (48, 64, 3)
    finally:
        session.unload()


@pytest.mark.slow
def test_failed_attention_install_keeps_native_sdpa(tiny_pipeline: Callable[[str], Path]) -> None:
    attempts: list[str] = []

    def failing_installer(package: str) -> bool:
        attempts.append(package)
        return False

    # FLUX's attention goes through diffusers' dispatcher (SDXL's UNet does not:
    # there the load keeps native SDPA without trying the install).
    session = session_for(tiny_pipeline("flux"), installer=failing_installer)
    session.plan = dataclasses.replace(
        session.plan.with_control("attention_backend", explicit("sage")), attention_install="sageattention"
    )
    session.load()
    try:
        assert attempts == ["sageattention"]
        attention = session.plan["attention_backend"]
        assert attention.value == "native" and "installing sageattention failed" in attention.reason
        assert pixels(session, width=64, height=64).shape == (64, 64, 3)
    finally:
        session.unload()


@pytest.mark.slow
def test_regional_compile_wraps_the_familys_blocks(tiny_pipeline: Callable[[str], Path]) -> None:
    """Graph capture with the cheap eager backend: the wiring, not inductor's speed."""
    session = session_for(tiny_pipeline("flux"), InferenceRequest(compile="on"), compile_backend="eager")
    session.load()
    try:
        assert session.plan.value("compile") == "regional"
        regions = set(REGISTRY.compile_regions(REGISTRY.family("flux")))
        blocks = [m for m in session.denoiser.modules() if type(m).__name__ in regions]
        assert blocks and all(m._compiled_call_impl is not None for m in blocks)
        assert pixels(session).shape == (48, 64, 3)
    finally:
        session.unload()


def test_progress_reports_every_step(tiny_pipeline: Callable[[str], Path]) -> None:
    session = session_for(tiny_pipeline("zimage"))
    session.load()
    seen: list[tuple[int, int]] = []
    try:
        session.generate(GenerateRequest("x", steps=3, **SIZE), progress=lambda s, t: seen.append((s, t)))
    finally:
        session.unload()
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_gpu_only_quantisation_configs_are_built_and_planned_on_cpu() -> None:
    """nf4 and the fp8 family need a GPU to run; their config objects and
    their plans are exercised here, where no GPU is."""
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig

    from engine.hardware.presets import preset
    from engine.runtime.quantize import nf4_config, torchao_config

    bnb = nf4_config(torch.bfloat16)
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4"  # type: ignore[attr-defined]
    assert isinstance(torchao_config("fp8", "cuda"), Float8DynamicActivationFloat8WeightConfig)
    assert isinstance(torchao_config("mxfp8", "cuda"), MXDynamicActivationMXWeightConfig)
    assert type(torchao_config("int8", "cuda")).__name__ == "Int8DynamicActivationInt8WeightConfig"
    assert type(torchao_config("int8", "cpu")).__name__ == "Int8WeightOnlyConfig"
    flux = REGISTRY.family("flux")
    from engine.policy.inference import ModelFacts

    facts = ModelFacts(flux, flux.default_checkpoint, REGISTRY.component_sizes(flux))
    assert plan_inference(REGISTRY, facts, preset("rtx4090"), InferenceRequest(quant="nf4")).value("transformer_quant") == "nf4"
    cpu = plan_inference(REGISTRY, facts, preset("rtx4090").replace(bitsandbytes_usable=False), InferenceRequest(quant="nf4"))
    assert cpu.value("transformer_quant") is None and "bitsandbytes" in cpu["transformer_quant"].reason


def test_hub_id_offline_fails_as_a_load_error_not_a_traceback() -> None:
    from engine.runtime.session import LoadFailed

    source = resolve_model(REGISTRY, "black-forest-labs/FLUX.1-schnell")
    plan = plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE.replace(total_memory_gb=200, free_memory_gb=200))
    session = InferenceSession(REGISTRY, source, plan)
    with pytest.raises(LoadFailed) as raised:
        session.load()
    assert "FLUX.1-schnell" in raised.value.message


@contextlib.contextmanager
def cached_and_plain(folder: Path, cache: str) -> Iterator[tuple[Any, Any]]:
    """Two loaded sessions of ``folder``: one asking for the step cache ``cache``, one uncached."""
    session = session_for(folder, InferenceRequest(step_cache=cache))
    plain = session_for(folder, InferenceRequest(step_cache="off"))
    session.load()
    plain.load()
    try:
        yield session, plain
    finally:
        session.unload()
        plain.unload()


@pytest.mark.slow
def test_taylorseer_predicts_the_steps_between_full_ones_close_to_the_uncached_image(
        tiny_pipeline: Callable[[str], Path]) -> None:
    """``--step-cache taylorseer``: engaged as asked, the image moved (steps were predicted, not
    run) but within a few levels of the uncached one at the same seed."""
    with cached_and_plain(tiny_pipeline("flux"), "taylorseer") as (session, plain):
        assert session.plan["step_cache"].value == "taylorseer" and "TaylorSeer" in session.plan["step_cache"].reason
        cached, uncached = pixels(session, seed=7, steps=12), pixels(plain, seed=7, steps=12)
        assert session.status()["step_cache_engaged"] is True and session.denoiser.is_cache_enabled
        drift = np.abs(cached.astype(np.float32) - uncached.astype(np.float32))
        assert drift.max() > 0 and drift.mean() < 8


@pytest.mark.slow
def test_magcache_skips_steps_by_the_checkpoints_ratios_and_follows_each_calls_step_count(
        tiny_pipeline: Callable[[str], Path]) -> None:
    """``--step-cache magcache`` on FLUX.1-dev (its table names diffusers' calibrated ratios):
    engaged as asked; at 20 steps the ratios let it skip steps, so the image moves from the
    uncached one at the same seed; a call of another step count runs with the ratios made for
    it (an interpolation diffusers does per count), and each call starts its state anew."""
    with cached_and_plain(tiny_pipeline("flux"), "magcache") as (session, plain):
        assert session.plan["step_cache"].value == "magcache" and "MagCache" in session.plan["step_cache"].reason
        for steps in (20, 12):
            cached, uncached = pixels(session, seed=7, steps=steps), pixels(plain, seed=7, steps=steps)
            assert session.status()["step_cache_engaged"] is True and session.denoiser.is_cache_enabled
            assert np.abs(cached.astype(np.float32) - uncached.astype(np.float32)).max() > 0, steps
        assert np.array_equal(pixels(session, seed=7, steps=12), cached)


@pytest.mark.slow
def test_seacache_reuses_wans_block_stack_near_the_uncached_clip_and_never_where_the_pipeline_cannot_follow(
        tiny_pipeline: Callable[[str], Path]) -> None:
    """``--step-cache seacache`` on Wan's text-to-video pipeline: engaged as asked; at 20 and 12
    steps it reuses the block stack's residual on some steps, so the clip moves from the uncached
    one at the same seed, by a level or two; a repeated call is identical (each call's trajectory
    starts anew). A call with an image runs WanImageToVideoPipeline, which hands its cache context
    no schedule: the cache is released for that call and the plan says why."""
    from PIL import Image

    clip = {"frames": 5, "width": 64, "height": 64}
    with cached_and_plain(tiny_pipeline("wan"), "seacache") as (session, plain):
        assert session.plan["step_cache"].value == "seacache"
        for steps in (20, 12):
            cached, uncached = pixels(session, seed=7, steps=steps, **clip), pixels(plain, seed=7, steps=steps, **clip)
            assert session.status()["step_cache_engaged"] is True and session.denoiser.is_cache_enabled
            drift = np.abs(cached.astype(np.float32) - uncached.astype(np.float32))
            assert 0 < drift.max() <= 4, steps
        assert np.array_equal(pixels(session, seed=7, steps=12, **clip), cached)
        pixels(session, seed=7, steps=12, image=Image.new("RGB", (64, 64), "red"), **clip)
        assert session.status()["step_cache_engaged"] is False and not session.denoiser.is_cache_enabled
        assert "hands its cache context" in session.plan["step_cache"].reason
