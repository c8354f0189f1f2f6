"""The inference plan: every preset x family x scheme, and each rule's reason."""

from __future__ import annotations

from tests.support import table_plan

import itertools
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.errors import PreflightError
from engine.hardware.presets import PRESETS, preset
from engine.contract.plugins import load_registry
from engine.policy.inference import CONTROLS, InferenceRequest, ModelFacts, Plan, plan_inference
from engine.policy.quant import QUANT_REQUESTS, lift_denials, quant_ladder
from engine.policy.speed import ATTENTION_INSTALL_ENV, FP16_ACCUM_KILL_SWITCH

REGISTRY = load_registry()
FAMILIES = sorted(REGISTRY.families)
NO_ENV: dict[str, str] = {}




def plan_or_code(family: str, hw: str, **request: object) -> Plan | str:
    try:
        return table_plan(family, hw, **request)
    except PreflightError as exc:
        return exc.code


MATRIX = list(itertools.product(sorted(PRESETS), FAMILIES, QUANT_REQUESTS))


@pytest.mark.parametrize(("hw", "family", "quant"), MATRIX)
def test_every_preset_family_and_scheme_plans_or_refuses_with_a_code(hw: str, family: str, quant: str) -> None:
    result = plan_or_code(family, hw, quant=quant)
    if isinstance(result, str):
        assert result in {"no_safe_dtype", "insufficient_memory"}, result
        return
    assert set(result.controls) == set(CONTROLS)
    for name in CONTROLS:
        resolved = result[name]
        assert resolved.source in ("auto", "explicit") and resolved.reason, (name, resolved)
    scheme = result.value("transformer_quant")
    # Denials a machine capability lifts (Qwen-Image fp8 with torchao's
    # activation-scale floor) are not in force there.
    spec = REGISTRY.family(family)
    denied = lift_denials(REGISTRY.quant_deny_reasons(spec, "inference"), spec, PRESETS[hw])
    assert scheme not in denied
    if quant not in ("auto", "none") and scheme is None:
        assert "falling back" in result["transformer_quant"].reason
    if scheme is not None and quant != "auto":
        # A fallback exists wherever the transformer as given fits at all (the
        # budget is now free - reserve: the dense Z-Image no longer fits the
        # cpu preset's RAM, so its int8 plan has nothing to fall back to).
        assert scheme == quant
        assert result.fallback is not None or plan_or_code(family, hw, quant="none") == "insufficient_memory"
    json.dumps(result.to_dict())  # the record is JSON-ready


def test_qwen_image_never_gets_fp8_family_schemes_nor_fp16_compute() -> None:
    """Over every preset and every scheme asked: one test for the rule, failing once with every
    (preset, scheme) that breaks it, rather than a row each."""
    broken = []
    for hw, quant in itertools.product(sorted(PRESETS), QUANT_REQUESTS):
        result = plan_or_code("qwen_image", hw, quant=quant)
        if isinstance(result, str):
            if result not in ("no_safe_dtype", "insufficient_memory") or (
                    result == "no_safe_dtype" and PRESETS[hw].native_bf16):
                broken.append(f"{hw}/{quant}: refused {result}")
            continue
        scheme, dtype = result.value("transformer_quant"), result.value("dtype")
        # fp8 is allowed for inference where torchao floors the activation scales
        # (every preset's torchao does); see tests/policy/test_earlier_decisions.py.
        if scheme in ("mxfp8", "nvfp4") or (scheme == "fp8" and not PRESETS[hw].fp8_activation_floor):
            broken.append(f"{hw}/{quant}: scheme {scheme}")
        if dtype == "fp16":
            broken.append(f"{hw}/{quant}: fp16 compute")
    assert broken == []


def test_explicit_denied_scheme_yields_no_scheme_with_the_measured_reason() -> None:
    # Without torchao's activation-scale floor the fp8 deny stands.
    result = table_plan("qwen_image", preset("b200").replace(fp8_activation_floor=False), quant="fp8")
    quant = result["transformer_quant"]
    assert quant.value is None and quant.source == "explicit"
    assert "black" in quant.reason and "falling back" in quant.reason


def test_explicit_unsupported_scheme_falls_back_with_the_reason() -> None:
    quant = table_plan("flux", "a100-80g", quant="fp8")["transformer_quant"]
    assert quant.value is None and "8.9+" in quant.reason
    assert table_plan("flux", "h100", quant="nvfp4")["transformer_quant"].value is None
    assert table_plan("flux", "b200", quant="nvfp4")["transformer_quant"].value == "nvfp4"


def test_h100_flux_is_bf16_resident_without_quantisation() -> None:
    result = table_plan("flux", "h100")
    assert (result.value("dtype"), result.value("memory_mode")) == ("bf16", "resident")
    assert result.value("transformer_quant") is None and result.fallback is None


def test_rtx4090_flux_picks_int8_first_and_keeps_a_fallback() -> None:
    result = table_plan("flux", "rtx4090")
    assert result.value("transformer_quant") == "int8"
    # The encoders do not fit beside the int8 denoiser: they are streamed, and
    # the denoiser stays resident instead of being offloaded per image.
    assert (result.value("memory_mode"), result.value("text_encoder_memory")) == ("resident", "streamed")
    assert result.fallback is not None
    assert result.fallback.value("transformer_quant") is None
    assert result.fallback.value("memory_mode") == "group_offload"


@pytest.mark.parametrize(
    ("hw", "ladder"),
    [("b200", ("fp8", "mxfp8", "int8")), ("h100", ("fp8", "int8")), ("l40s", ("fp8", "int8")),
     ("a100-80g", ("int8",)), ("rtx4090", ("int8", "fp8")), ("rtx5090", ("int8", "fp8", "mxfp8"))],
)
def test_quant_ladder_by_capability_with_consumer_int8_first(hw: str, ladder: tuple[str, ...]) -> None:
    assert quant_ladder(PRESETS[hw]) == ladder


def test_auto_skips_denied_schemes_for_the_family() -> None:
    # Without torchao's activation-scale floor Qwen-Image's fp8 deny stands.
    # (All 47.8 GB free: int8 now keeps the text stream dense, 34 GB steady.)
    tight = preset("l40s").replace(fp8_activation_floor=False)
    qwen = table_plan("qwen_image", tight)["transformer_quant"]
    assert qwen.value == "int8" and "fp8" in qwen.reason  # skipped, and says so
    assert table_plan("flux", tight.replace(free_memory_gb=30.0))["transformer_quant"].value == "fp8"
    assert table_plan("qwen_image", preset("l40s"))["transformer_quant"].value == "fp8"  # the floor lifts it


def test_a_host_quantised_candidate_is_sized_at_its_steady_size() -> None:
    # int8 is quantised on the host and moved quantised: the device never holds
    # the 40.9 GB dense weights, so int8 (34 GB: the text stream stays bf16)
    # beats streaming the dense blocks. (fp8 floor off: Qwen-Image's fp8 deny
    # stands, so the candidate is int8; all 47.8 GB free.)
    result = table_plan("qwen_image", preset("l40s").replace(fp8_activation_floor=False))
    assert result.value("transformer_quant") == "int8"
    # Without its (fp8) encoders it fits resident: they are streamed per prompt.
    assert (result.value("memory_mode"), result.value("text_encoder_memory")) == ("resident", "streamed")
    parts = result.estimate.components
    assert parts.transformer_transient_gb == parts.transformer_gb < 40.0


def test_a_candidate_whose_build_peak_does_not_fit_is_not_taken() -> None:
    # nf4 is quantised while bitsandbytes loads onto the device: its build peak
    # is the dense transformer, which 40 GB free cannot hold.
    result = table_plan("qwen_image", preset("l40s").replace(free_memory_gb=40.0), quant="nf4")
    assert result.value("transformer_quant") == "nf4"
    assert result.estimate.components.transformer_transient_gb == 40.9
    # 12.3 GB steady would sit beside the encoders, but the 40.9 GB build cannot.
    assert result.value("memory_mode") == "group_offload"


def test_dense_quant_candidate_beats_offload_only_when_it_improves_the_plan() -> None:
    # Qwen-Image on a 4090: int8 (22.5 GB) still cannot sit beside a transformer-sized peak.
    result = table_plan("qwen_image", "rtx4090")
    assert result.value("transformer_quant") is None
    assert "would not improve" in result["transformer_quant"].reason


def test_max_tier_quantises_for_speed_even_when_dense_fits() -> None:
    assert table_plan("flux", "h100", speed="max").value("transformer_quant") == "fp8"
    assert table_plan("flux", "h100").value("transformer_quant") is None


@pytest.mark.parametrize("hw", ["t4", "v100", "rtx2080ti"])
def test_no_native_bf16_gives_fp16_only_to_fp16_safe_families(hw: str) -> None:
    assert table_plan("flux", hw).value("dtype") == "fp16"
    assert table_plan("sdxl", hw).value("dtype") == "fp16"
    for family in ("qwen_image", "zimage"):
        result = plan_or_code(family, hw)
        assert result == "no_safe_dtype" or result.value("dtype") == "fp32"  # type: ignore[union-attr]


def test_unsafe_family_gets_fp32_when_it_fits() -> None:
    big_v100 = preset("v100").replace(total_memory_gb=80.0, free_memory_gb=79.0)
    result = table_plan("zimage", big_v100)
    assert result.value("dtype") == "fp32" and "fails in attention" in result["dtype"].reason


def test_explicit_bf16_on_t4_and_fp16_on_qwen_image_are_refused() -> None:
    with pytest.raises(PreflightError) as raised:
        table_plan("flux", "t4", dtype="bf16")
    assert raised.value.code == "bf16_unsupported"
    with pytest.raises(PreflightError) as raised:
        table_plan("qwen_image", "h100", dtype="fp16")
    assert raised.value.code == "fp16_unsafe" and "black" in raised.value.message


def test_memory_budget_reserve_and_resident_fraction() -> None:
    result = table_plan("zimage", preset("h100"))
    estimate = result.estimate
    # The reserve is taken from free memory (84.5 GB on the preset), not total.
    assert estimate.budget_gb == pytest.approx(84.5 - 8.5)  # 10% reserve > 2 GiB
    unified = table_plan("zimage", "apple-m3-max").estimate
    assert unified.budget_gb == pytest.approx(96.0 - 128.0 * 0.2)


def test_explicit_memory_mode_that_cannot_fit_falls_to_the_next_that_does() -> None:
    """The earlier system's later rule (FACTS.md, Memory): an explicit fast/resident
    request that does not fit falls to the next tier rather than failing; the
    record keeps what was asked (status ``fell back``, so ``--strict`` refuses it)."""
    fell = table_plan("qwen_image", "rtx4090", memory="resident")["memory_mode"].to_dict()
    assert fell["requested"] == "resident" and fell["status"] == "fell back" and fell["overridden"] is True
    assert fell["value"] in ("model_offload", "group_offload", "sequential_offload")
    assert "memory=resident does not fit" in str(fell["reason"])
    assert table_plan("qwen_image", "rtx4090", memory="sequential_offload").value("memory_mode") == "sequential_offload"


@pytest.mark.parametrize(("steps", "engaged"), [(28, True), (20, True), (19, False), (4, False)])
def test_step_cache_engages_from_20_steps(steps: int, engaged: bool) -> None:
    result = table_plan("flux", "h100", steps=steps, speed="default")
    assert (result.value("step_cache") == "fbcache") is engaged
    assert result.step_cache_threshold == 0.08


def test_step_cache_threshold_is_higher_on_a_quantised_transformer() -> None:
    result = table_plan("flux", "rtx4090", steps=28)
    assert result.value("step_cache") == "fbcache" and result.step_cache_threshold == 0.12


def test_step_cache_follows_the_checkpoints_schedule_and_pins() -> None:
    assert table_plan("flux", "h100", speed="default").value("step_cache") == "fbcache"  # FLUX.1-dev: 28 steps
    schnell = REGISTRY.family("flux").checkpoint("flux.1-schnell")
    facts = ModelFacts(REGISTRY.family("flux"), schnell, REGISTRY.component_sizes(REGISTRY.family("flux")))
    default = InferenceRequest(speed="default")
    assert plan_inference(REGISTRY, facts, preset("h100"), default, env=NO_ENV).value("step_cache") == "off"
    pinned = table_plan("flux", "h100", steps=4, step_cache="fbcache")["step_cache"]
    assert (pinned.value, pinned.source) == ("fbcache", "explicit")


def test_magcache_is_offered_where_the_checkpoint_names_its_calibrated_ratios() -> None:
    """FLUX.1-dev's table names diffusers' ratios: asked for, MagCache is planned; schnell and Wan
    name none: the asked cache is overridden to off, the reason says what MagCache needs. The
    table safeguard: without dev's entry, dev is refused the same way."""
    import dataclasses

    dev = table_plan("flux", "h100", step_cache="magcache")["step_cache"]
    assert (dev.value, dev.source) == ("magcache", "explicit") and "calibrated magnitude ratios" in dev.reason
    for family, checkpoint in (("flux", "flux.1-schnell"), ("wan", None)):
        refused = table_plan(family, "h100", checkpoint, step_cache="magcache")["step_cache"]
        assert refused.value == "off" and refused.overridden and "calibrated on the checkpoint" in refused.reason
    spec = REGISTRY.family("flux")
    bare = dataclasses.replace(spec.default_checkpoint, mag_ratios=None)
    facts = ModelFacts(spec, bare, REGISTRY.component_sizes(spec, bare))
    asked = plan_inference(REGISTRY, facts, preset("h100"), InferenceRequest(step_cache="magcache"), env=NO_ENV)
    assert asked.value("step_cache") == "off"


def test_seacache_is_offered_where_the_pipeline_hands_it_the_schedule() -> None:
    """Wan's text-to-video pipeline hands each cache context the step, sigma and step count, and
    diffusers has a SeaCache adapter for its denoiser: asked for, SeaCache is planned (Wan 2.1 and
    the 2.2 TI2V-5B). The image-to-video pipeline and FLUX name neither: the asked cache is
    overridden to off with what SeaCache needs. The table safeguard: without Wan's list, the
    text-to-video checkpoint is refused the same way."""
    import dataclasses

    for checkpoint in ("wan2.1-t2v-1.3b", "wan2.2-ti2v-5b"):
        planned = table_plan("wan", "h100", checkpoint, step_cache="seacache")["step_cache"]
        assert (planned.value, planned.source) == ("seacache", "explicit") and "SeaCache" in planned.reason
    for family, checkpoint in (("wan", "wan2.1-i2v-14b"), ("flux", None), ("hunyuan_video", None)):
        refused = table_plan(family, "h100", checkpoint, step_cache="seacache")["step_cache"]
        assert refused.value == "off" and refused.overridden and "hands its cache context" in refused.reason
    spec = REGISTRY.family("wan")
    bare = dataclasses.replace(spec, pipeline=dataclasses.replace(spec.pipeline, sea_cache_pipelines=()))
    chosen = spec.checkpoint("wan2.1-t2v-1.3b")
    facts = ModelFacts(bare, chosen, REGISTRY.component_sizes(bare, chosen))
    asked = plan_inference(REGISTRY, facts, preset("h100"), InferenceRequest(step_cache="seacache"), env=NO_ENV)
    assert asked.value("step_cache") == "off"


def test_step_cache_is_off_where_the_family_denies_it() -> None:
    result = table_plan("zimage", "h100", steps=28)
    assert result.value("step_cache") == "off" and "cache hooks" in result["step_cache"].reason


def test_compile_drops_fullgraph_when_an_auto_cache_could_engage() -> None:
    assert table_plan("flux", "h100", speed="default").compile_fullgraph is False
    assert table_plan("flux", "h100", speed="default", step_cache="off").compile_fullgraph is True
    assert table_plan("zimage", "h100", speed="default").compile_fullgraph is True  # no cache can engage
    assert table_plan("sdxl", "cpu").value("compile") == "off"
    assert table_plan("flux", "h100", speed="eager").value("compile") == "off"


@pytest.mark.parametrize(
    ("hw", "family", "speed", "env", "expected"),
    [
        ("rtx4090", "flux", "default", {}, True),  # consumer, bf16: neutral, engage
        ("h100", "flux", "default", {}, False),  # datacenter: no gain
        ("rtx2080ti", "sdxl", "default", {}, False),  # fp16 compute: only on max
        ("rtx2080ti", "sdxl", "max", {}, True),
        ("rtx4090", "flux", "off", {}, False),
        ("rtx4090", "flux", "default", {FP16_ACCUM_KILL_SWITCH: "1"}, False),
        ("apple-m3-max", "sdxl", "max", {}, False),
    ],
)
def test_fp16_accumulation_gate(hw: str, family: str, speed: str, env: dict[str, str], expected: bool) -> None:
    assert table_plan(family, hw, env=env, speed=speed).value("fp16_accumulation") is expected


def test_fp16_accumulation_needs_torch_that_exposes_the_flag() -> None:
    old_torch = preset("rtx4090").replace(torch_fp16_accumulation=False)
    result = table_plan("flux", old_torch)["fp16_accumulation"]
    assert result.value is False and "2.7" in result.reason


def test_attention_explicit_backend_the_card_cannot_run_falls_back_to_native() -> None:
    result = table_plan("flux", "t4", attention="sage")
    assert result.value("attention_backend") == "native" and "sm80" in result["attention_backend"].reason
    assert result.attention_install is None
    assert table_plan("flux", "rtx4090", attention="flash3").value("attention_backend") == "native"


def test_attention_install_only_for_explicit_requests_after_the_arch_gate() -> None:
    result = table_plan("flux", "rtx4090", attention="sage")
    # The install carries the version floor and --no-deps (keeps the installed torch).
    assert result.value("attention_backend") == "sage"
    assert result.attention_install == "sageattention>=2.1.1 --no-deps"
    assert table_plan("flux", "rtx4090").attention_install is None
    off = table_plan("flux", "rtx4090", env={ATTENTION_INSTALL_ENV: "0"}, attention="sage")
    assert off.value("attention_backend") == "native" and off.attention_install is None
    installed = preset("rtx4090").replace(attention_packages=("sageattention",))
    ready = table_plan("flux", installed, attention="sage")
    assert ready.value("attention_backend") == "sage" and ready.attention_install is None


def test_attention_auto_uses_flash3_on_hopper_when_installed() -> None:
    hopper = preset("h100").replace(attention_packages=("kernels",))
    assert table_plan("flux", hopper, speed="default").value("attention_backend") == "flash3"
    # Without FA3, auto takes cuDNN's fused SDPA on sm80+.
    assert table_plan("flux", "h100", speed="default").value("attention_backend") == "cudnn"


@pytest.mark.parametrize(("cpus", "cores", "threads"), [
    (16, None, 8), (2, None, 1), (1, None, 1), (None, None, 8),  # topology unknown: half the logical cores
    (16, 8, 8), (2, 2, 2), (8, 6, 6),  # one thread per physical core, SMT siblings counted once
])
def test_cpu_threads_are_one_per_physical_core(cpus: int | None, cores: int | None, threads: int) -> None:
    cpu = preset("cpu").replace(cpu_count=cpus, physical_cores=cores)
    shared = table_plan("sdxl", cpu, env={"OMP_NUM_THREADS": "3"})["threads"]  # processes sharing the cores set it
    assert shared.value == 3 and "OMP_NUM_THREADS=3" in shared.reason
    assert table_plan("sdxl", cpu).value("threads") == threads
    assert table_plan("sdxl", "h100").value("threads") is None


def test_a_tiny_denoiser_plans_one_thread_and_a_real_width_one_a_thread_per_core(
    tiny_pipeline: Callable[[str], Path],
) -> None:
    """The tiny FLUX (15 MB of transformer) cannot feed two threads (they spin at their barriers);
    SDXL at its real width (5.1 GB of UNet) takes one per physical core, as on this 2-core machine."""
    from engine.preflight.model import resolve_model

    registry = load_registry()
    cpu = preset("cpu").replace(cpu_count=2, physical_cores=2)
    facts = resolve_model(registry, tiny_pipeline("flux")).facts(registry)
    tiny = plan_inference(registry, facts, cpu, InferenceRequest(), env={})["threads"]
    assert tiny.value == 1 and "too narrow to feed two threads" in tiny.reason
    assert table_plan("sdxl", cpu).value("threads") == 2
    asked = plan_inference(registry, facts, cpu, InferenceRequest(threads=2), env={})["threads"]
    assert asked.value == 2  # an explicit count wins


def test_invalid_request_values_are_refused_with_a_code() -> None:
    for field, value in (("speed", "turbo"), ("attention", "magic"), ("compile", "yes"), ("dtype", "fp8")):
        with pytest.raises(PreflightError):
            table_plan("flux", "h100", **{field: value})


def test_planning_imports_no_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        from engine.hardware.presets import PRESETS
        from engine.contract.plugins import load_registry
        from engine.policy.inference import ModelFacts, plan_inference
        from engine.errors import PreflightError
        r = load_registry()
        for hw in PRESETS.values():
            for f in r.families.values():
                try:
                    plan_inference(r, ModelFacts(f, f.default_checkpoint, r.component_sizes(f)), hw)
                except PreflightError:
                    pass
        print("torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_quant_filter_sizes_from_tensor_shapes_match_the_rule() -> None:
    from engine.policy.quant_filter import quantised_gb, quantises

    tensors = [
        ("blocks.0.attn.to_q.weight", (1024, 1024)),  # quantised
        ("blocks.0.attn.to_q.bias", (1024,)),  # stays bf16
        ("blocks.0.norm1.linear.weight", (6144, 1024)),  # int8 skips modulation
        ("proj_small.weight", (64, 1024)),  # under 512 features
        ("conv_in.weight", (320, 4, 3, 3)),  # not a Linear
    ]
    int8 = quantised_gb(tensors, "int8") * 1e9
    assert int8 == pytest.approx(1024 * 1024 * 1 + 1024 * 5 + (1024 + 6144 * 1024 + 64 * 1024 + 320 * 36) * 2)
    fp8 = quantised_gb(tensors, "fp8") * 1e9
    assert fp8 < int8  # fp8 takes the modulation Linear too
    assert not quantises("int8", "time_text_embed.timestep_embedder.linear_1", 1024, 1024)
    assert quantises("fp8", "time_text_embed.timestep_embedder.linear_1", 1024, 1024)
    assert not quantises("mxfp8", "x", 528, 1024)  # dims must divide by 32


def test_local_checkpoints_are_planned_with_their_own_quantised_sizes(tiny_pipeline) -> None:  # type: ignore[no-untyped-def]
    from engine.preflight.model import resolve_model

    facts = resolve_model(REGISTRY, tiny_pipeline("flux")).facts(REGISTRY)
    assert facts.measured_scheme_gb is not None
    assert facts.measured_scheme_gb["int8"] < facts.measured_sizes.transformer_gb  # type: ignore[union-attr]
    result = plan_inference(REGISTRY, facts, preset("cpu"), InferenceRequest(quant="int8"), env=NO_ENV)
    assert result.estimate.components.transformer_gb == facts.measured_scheme_gb["int8"]


def test_the_step_cache_thresholds_a_caller_passes_are_the_ones_planned_with() -> None:
    """``plan_inference(cache_thresholds=...)`` decides the step cache (it was a parameter nothing read)."""
    from engine.policy.speed import StepCacheThresholds

    family = REGISTRY.family("flux")
    facts = ModelFacts(family, family.default_checkpoint, REGISTRY.component_sizes(family, family.default_checkpoint))
    request = InferenceRequest(steps=28, speed="default")
    usual = plan_inference(REGISTRY, facts, preset("h100"), request, env=NO_ENV)
    strict = plan_inference(REGISTRY, facts, preset("h100"), request, env=NO_ENV,
                            cache_thresholds=StepCacheThresholds(min_steps=1000, threshold=0.3))
    assert usual.value("step_cache") == "fbcache" and strict.value("step_cache") == "off"
    assert "28 steps < 1000" in strict["step_cache"].reason
