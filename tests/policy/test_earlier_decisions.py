"""Inference decisions held to what the earlier system measured, one per item.

Each test names the decision it pins; a regression flips its assert. Machines
other than this one are hardware presets; the models are the families' tables,
and, where the runtime decides, tiny real pipelines on this CPU.
"""

from __future__ import annotations

from tests.support import table_plan

import dataclasses
import inspect
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.errors import PreflightError
from engine.hardware import probe as probe_module
from engine.hardware.presets import PRESETS, preset
from engine.hardware.profile import GIB_IN_GB, HardwareProfile
from engine.contract.hookspecs import hookimpl
from engine.contract.plugins import load_registry
from engine.contract.types import FamilySpec, QuantDeny
from engine.policy.inference import CONTROLS, InferenceRequest, ModelFacts, plan_inference
from engine.policy.memory import budget_gb
from engine.policy.quant import quant_ladder
from engine.policy.quant_filter import dense_gb, quantised_gb, quantises
from engine.policy.resolved import STATUSES, explicit
from engine.policy.speed import COMPILE_FROM_IMAGE
from engine.policy.training import training_precision_preflight_error
from tests.support import run_cli

REGISTRY = load_registry()
NO_ENV: dict[str, str] = {}




def cli_plan(*args: str) -> dict[str, object]:
    result = run_cli("plan", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["plan"]


# -- 1. the step cache only where the pipeline opens a cache context -----------


def test_1_kontext_plans_no_step_cache_and_says_why() -> None:
    kontext = cli_plan("--family", "flux", "--checkpoint", "flux.1-kontext-dev", "--hardware", "h100",
                       "--speed", "default")
    cache = kontext["resolved"]["step_cache"]  # type: ignore[index]
    assert cache["value"] == "off" and "no cache context" in cache["reason"]
    assert "FluxKontextPipeline" in cache["reason"]
    # The fullgraph compile stays on: no cache can engage later.
    assert kontext["compile_fullgraph"] is True
    # The text-to-image pipeline of the same family keeps it.
    assert table_plan("flux", "h100", "flux.1-dev", speed="default").value("step_cache") == "fbcache"
    pinned = table_plan("flux", "h100", "flux.1-kontext-dev", step_cache="fbcache")["step_cache"]
    assert pinned.value == "off" and pinned.to_dict()["status"] == "refused"


def test_1_family_tables_say_which_pipelines_carry_the_cache_context() -> None:
    import diffusers

    for name, spec in REGISTRY.families.items():
        declared = spec.pipeline.cache_context_pipelines
        assert declared is not None, f"{name} does not declare its cache-context pipelines"
        for class_name in spec.pipeline_class_names:
            call = inspect.getsource(getattr(diffusers, class_name).__call__)
            # The table agrees with the installed diffusers, class by class.
            assert (class_name in declared) == ("cache_context" in call), (name, class_name)


def _kontext_copy(tiny_flux: Path, where: Path) -> Path:
    """The tiny FLUX's components as a FluxKontextPipeline (the same parts)."""
    folder = where / "flux.1-kontext-dev-tiny"
    shutil.copytree(tiny_flux, folder)
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    index["_class_name"] = "FluxKontextPipeline"
    (folder / "model_index.json").write_text(json.dumps(index), encoding="utf-8")
    return folder


def _session(model: Path, request: InferenceRequest, family_override: object = None, **options: object):  # type: ignore[no-untyped-def]
    from engine.preflight.model import resolve_model
    from engine.runtime.session import InferenceSession

    source = resolve_model(REGISTRY, model)
    if family_override is not None:
        source = dataclasses.replace(source, family=family_override)
    cpu = preset("cpu").replace(cpu_count=2, free_memory_gb=16.0)
    planned = plan_inference(REGISTRY, source.facts(REGISTRY), cpu, request, env=NO_ENV)
    return InferenceSession(REGISTRY, source, planned, request, **options)  # type: ignore[arg-type]


def test_1_a_tiny_kontext_pipeline_loads_with_the_cache_off(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    request = InferenceRequest(step_cache="fbcache")
    session = _session(_kontext_copy(tiny_pipeline("flux"), tmp_path), request)
    assert session.plan.value("step_cache") == "off"  # planned off from the checkpoint's pipeline
    session.plan = session.plan.with_control("step_cache", explicit("fbcache"))  # as if unplanned
    session.load()
    try:
        assert type(session.pipeline).__name__ == "FluxKontextPipeline"
        # Checked on the loaded pipeline before enabling: never enabled.
        assert not session.status()["step_cache_engaged"]
        cache = session.plan["step_cache"]
        assert cache.value == "off" and "no cache context" in cache.reason
        assert not getattr(session.denoiser, "is_cache_enabled", False)
    finally:
        session.unload()


@pytest.mark.slow
def test_1_tiny_flux_without_a_cache_context_generates_20_steps_with_the_cache_off(
    tiny_pipeline: Callable[[str], Path],
) -> None:
    from engine.runtime.session import GenerateRequest

    flux = REGISTRY.family("flux")
    no_context = dataclasses.replace(flux, pipeline=dataclasses.replace(flux.pipeline, cache_context_pipelines=()))
    session = _session(tiny_pipeline("flux"), InferenceRequest(steps=20, speed="default"), family_override=no_context)
    session.load()
    try:
        [image] = session.generate(GenerateRequest("a lighthouse", steps=20, width=64, height=48))
        assert image.size == (64, 48)
        record = session.status()["plan"]["resolved"]["step_cache"]  # type: ignore[index]
        assert record["value"] == "off" and "no cache context" in record["reason"]
        assert record["requested"] == "auto" and record["status"] == "not applicable"
        assert not session.status()["step_cache_engaged"]
    finally:
        session.unload()


# -- 2. no fullgraph compile under offload hooks ---------------------------------


def test_2_offload_hooks_turn_fullgraph_off() -> None:
    offloaded = cli_plan("--family", "flux", "--hardware", "rtx4090", "--quant", "none", "--step-cache", "off",
                         "--speed", "default")
    assert offloaded["resolved"]["memory_mode"]["value"] == "group_offload"  # type: ignore[index]
    assert offloaded["resolved"]["compile"]["value"] == "regional"  # type: ignore[index]
    assert offloaded["compile_fullgraph"] is False
    assert "offload hooks" in offloaded["resolved"]["compile"]["reason"]  # type: ignore[index]
    resident = table_plan("flux", "h100", step_cache="off", speed="default")
    assert resident.value("memory_mode") == "resident" and resident.compile_fullgraph is True


# -- 3. unified memory: resident or refused ---------------------------------------


def test_3_unified_memory_refuses_what_does_not_fit_instead_of_offloading() -> None:
    result = run_cli("plan", "--family", "qwen_image", "--hardware", "apple-m3-max", "--free-gb", "20")
    assert result.returncode == 2
    assert "insufficient_memory" in result.stderr and "frees nothing" in result.stderr
    spark = preset("dgx-spark")
    assert spark.unified_memory and spark.vendor == "nvidia"
    with pytest.raises(PreflightError) as raised:
        table_plan("flux", spark.replace(free_memory_gb=30.0), quant="none")
    assert raised.value.code == "insufficient_memory"


@pytest.mark.parametrize("hw", ["apple-m3-max", "dgx-spark"])
def test_3_unified_memory_never_plans_offload(hw: str) -> None:
    for family in sorted(REGISTRY.families):
        try:
            result = table_plan(family, hw)
        except PreflightError as exc:
            assert exc.code in ("insufficient_memory", "no_safe_dtype")
            continue
        assert result.value("memory_mode") == "resident"
    asked = table_plan("zimage", hw, memory="model_offload")["memory_mode"]
    assert asked.value == "resident" and asked.to_dict()["status"] == "not applicable"
    assert "frees nothing" in asked.reason


# -- 4. no torchao schemes where they run badly or not at all -----------------------


def test_4_no_dense_quant_below_sm80_on_cpu_or_with_fp16_compute() -> None:
    t4 = cli_plan("--family", "sdxl", "--hardware", "t4", "--quant", "int8")
    quant = t4["resolved"]["transformer_quant"]  # type: ignore[index]
    assert quant["value"] is None and quant["requested"] == "int8" and quant["status"] == "refused"
    assert "sm80" in quant["reason"]
    for hw in ("t4", "v100", "rtx2080ti", "cpu"):
        assert quant_ladder(PRESETS[hw]) == ()
        assert table_plan("sdxl", hw).value("transformer_quant") is None
    # fp16 compute on an Ampere card: no torchao scheme either.
    fp16 = table_plan("sdxl", "a100-80g", dtype="fp16", quant="int8")["transformer_quant"]
    assert fp16.value is None and "bf16 compute" in fp16.reason
    assert quant_ladder(PRESETS["a100-80g"], "fp16") == ()
    # An explicit int8 on the CPU is still honoured (it runs, and halves RAM).
    assert table_plan("sdxl", "cpu", quant="int8").value("transformer_quant") == "int8"


# -- 5. int8 exclusions per family ----------------------------------------------------

QWEN_TEXT_STREAM = (
    "txt_in",
    "transformer_blocks.3.attn.add_q_proj",
    "transformer_blocks.3.attn.add_k_proj",
    "transformer_blocks.3.attn.add_v_proj",
    "transformer_blocks.3.attn.to_add_out",
    "transformer_blocks.3.txt_mlp.net.0.proj",
)


def test_5_qwen_image_keeps_its_text_stream_dense_for_int8() -> None:
    qwen = REGISTRY.family("qwen_image").quantisation.int8_dense_modules
    flux = REGISTRY.family("flux").quantisation.int8_dense_modules
    for name in QWEN_TEXT_STREAM:
        assert not quantises("int8", name, 3072, 3072, qwen), name
        assert quantises("fp8", name, 3072, 3072, qwen), name  # int8's M >= 16 rule only
    assert quantises("int8", "transformer_blocks.3.attn.to_q", 3072, 3072, qwen)
    # context_embedder runs at padded text length: quantised; M = batch embedders are not.
    assert quantises("int8", "context_embedder", 4096, 3072, flux)
    assert not quantises("int8", "time_text_embed.text_embedder.linear_1", 768, 3072, flux)
    assert not quantises("int8", "time_text_embed.timestep_embedder.linear_1", 768, 3072, qwen)
    # The planner sizes with the same family tokens.
    shapes = [(f"{n}.weight", (3072, 3072)) for n in QWEN_TEXT_STREAM]
    assert quantised_gb(shapes, "int8", qwen) == pytest.approx(dense_gb(shapes))
    assert quantised_gb(shapes, "int8") < dense_gb(shapes)


def test_5_the_runtime_filter_uses_the_family_tokens(
    tiny_pipeline: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from engine.runtime import quantize

    qwen = REGISTRY.family("qwen_image").quantisation.int8_dense_modules
    keep = quantize.module_filter("int8", qwen)
    layer = torch.nn.Linear(1024, 1024)
    assert not keep(layer, "transformer_blocks.0.txt_mlp.net.2")
    assert keep(layer, "transformer_blocks.0.img_mlp.net.2")
    # The session builds its filter from the family's table (spied, not faked).
    calls: list[tuple[str, tuple[str, ...]]] = []
    real = quantize.module_filter

    def spy(scheme: str, dense_modules: tuple[str, ...] = ()) -> quantize.ModuleFilter:
        calls.append((scheme, dense_modules))
        return real(scheme, dense_modules)

    monkeypatch.setattr(quantize, "module_filter", spy)
    session = _session(tiny_pipeline("qwen_image"), InferenceRequest(quant="int8"))
    session.load()  # no tiny layer is 512 wide: the int8 build fails and the fallback loads
    try:
        assert calls and calls[0] == ("int8", qwen)
    finally:
        session.unload()


# -- 6. the reserve comes out of free memory ------------------------------------------


def test_6_budget_is_free_memory_less_the_reserve() -> None:
    card = HardwareProfile(
        name="16g", vendor="nvidia", device_name="GeForce RTX 4080", total_memory_gb=16 * GIB_IN_GB,
        free_memory_gb=15.87 * GIB_IN_GB, capability=(8, 9), native_bf16=True,
    )
    # max(2 GiB, 10% of 16 GiB) = 2 GiB taken from the 15.87 GiB free.
    assert budget_gb(card) / GIB_IN_GB == pytest.approx(13.87)
    busy = card.replace(free_memory_gb=8 * GIB_IN_GB)
    assert budget_gb(busy) / GIB_IN_GB == pytest.approx(6.0)


# -- 7. offload order (kept: whole components first, with the stricter budget) ----------


def test_7_model_offload_only_where_the_transformer_fits_with_the_reserve_taken_from_free() -> None:
    # Dense, resident encoders: int8 encoders (auto on sm80) would make it
    # resident, and streaming them would keep the transformer resident.
    roomy = table_plan("flux", "a100-40g", quant="none", text_encoder_quant="none", text_encoder_memory="resident")
    assert roomy.value("memory_mode") == "model_offload"
    assert "stays on the device" in roomy["memory_mode"].reason
    # 33 GB free: the transformer (23.8 + 2.1 overhead) fits 0.85 x 33, but not
    # 0.85 x (33 - 4.2 reserve): the case whole-component offload spills in.
    tight = table_plan("flux", preset("a100-40g").replace(free_memory_gb=33.0), quant="none", text_encoder_quant="none")
    assert tight.value("memory_mode") == "group_offload"


# -- 8. consumer / workstation / datacenter by name ---------------------------------------


@pytest.mark.parametrize(
    ("name", "klass"),
    [("NVIDIA RTX A4000", "workstation"), ("NVIDIA RTX A5000", "workstation"),
     ("NVIDIA RTX 6000 Ada Generation", "datacenter"), ("NVIDIA Fancy New GPU", "consumer"),
     ("NVIDIA GeForce RTX 4090", "consumer"), ("NVIDIA H100 80GB HBM3", "datacenter"), ("Tesla T4", "datacenter")],
)
def test_8_gpu_class_by_name(name: str, klass: str) -> None:
    assert probe_module.gpu_class(name) == klass
    assert probe_module.consumer_class(name) is (klass != "datacenter")


def test_8_the_class_moves_int8_first_and_fp16_accumulation() -> None:
    a4000, ada = preset("rtx-a4000"), preset("rtx6000-ada")
    assert a4000.consumer and not ada.consumer
    assert quant_ladder(ada) == ("fp8", "int8")
    assert quant_ladder(ada.replace(consumer=True)) == ("int8", "fp8")
    assert table_plan("flux", a4000, speed="default").value("fp16_accumulation") is True
    assert table_plan("flux", ada, speed="default").value("fp16_accumulation") is False


# -- 9. speed details ---------------------------------------------------------------------


def test_9_dense_models_compile_from_the_third_image() -> None:
    dense = table_plan("flux", "h100", speed="default")
    assert dense.value("compile") == "regional" and dense.compile_from_image == COMPILE_FROM_IMAGE == 3
    assert "image 3" in dense["compile"].reason
    assert table_plan("flux", "h100", compile="on").compile_from_image == 1
    assert table_plan("flux", "rtx4090").value("transformer_quant") == "int8"
    assert table_plan("flux", "rtx4090").compile_from_image == 1  # quantised kernels gain from compile


def test_9_fp16_gguf_dynamo_and_tf32() -> None:
    t4 = table_plan("sdxl", "t4")
    assert t4.value("dtype") == "fp16" and t4.value("compile") == "off"
    assert table_plan("flux", "h100", gguf_gb=12.7).value("compile") == "off"
    maxed = table_plan("flux", "h100", gguf_gb=12.7, speed="max", quant="none")
    assert maxed.value("compile") == "regional" and maxed.compile_fullgraph is False
    disabled = table_plan("flux", "h100", env={"TORCHDYNAMO_DISABLE": "1"})
    assert disabled.value("compile") == "off" and "TORCHDYNAMO_DISABLE" in disabled["compile"].reason
    forced = table_plan("flux", "h100", env={"TORCHDYNAMO_DISABLE": "1"}, compile="on")["compile"]
    assert forced.value == "off" and forced.to_dict()["status"] == "refused"
    assert table_plan("flux", "h100").value("tf32") is False
    assert table_plan("flux", "h100", speed="max").value("tf32") is True


@pytest.mark.slow
def test_9_the_session_compiles_before_the_third_image(tiny_pipeline: Callable[[str], Path]) -> None:
    from engine.runtime.session import GenerateRequest

    session = _session(tiny_pipeline("flux"), InferenceRequest(compile="on"), compile_backend="eager")
    session.plan = dataclasses.replace(session.plan, compile_from_image=3)
    regions = set(REGISTRY.compile_regions(REGISTRY.family("flux")))

    def compiled() -> bool:
        blocks = [m for m in session.denoiser.modules() if type(m).__name__ in regions]
        return bool(blocks) and all(m._compiled_call_impl is not None for m in blocks)

    session.load()
    try:
        seen = []
        for _ in range(3):
            seen.append(compiled())
            session.generate(GenerateRequest("a fox", steps=2, width=64, height=48))
        seen.append(compiled())
        assert seen == [False, False, False, True]
    finally:
        session.unload()


# -- 10. attention --------------------------------------------------------------------------


def test_10_cudnn_attention_auto_on_sm80_and_explicit() -> None:
    assert table_plan("flux", "a100-80g", speed="default").value("attention_backend") == "cudnn"
    assert table_plan("flux", "t4").value("attention_backend") == "native"
    assert table_plan("flux", "apple-m3-max").value("attention_backend") == "native"
    # cuDNN's kernel takes half-precision inputs only: an fp32 plan keeps native SDPA.
    assert table_plan("zimage", "a100-80g", dtype="fp32").value("attention_backend") == "native"
    assert table_plan("zimage", "a100-80g", dtype="fp32", attention="cudnn").value("attention_backend") == "native"
    asked = cli_plan("--family", "flux", "--hardware", "rtx4090", "--attention", "cudnn")
    assert asked["resolved"]["attention_backend"]["value"] == "cudnn"  # type: ignore[index]
    from engine.runtime.attention import DIFFUSERS_BACKENDS

    assert DIFFUSERS_BACKENDS["cudnn"] == "_native_cudnn"


def test_10_unknown_capability_does_not_block_and_installs_are_pinned() -> None:
    unknown = preset("rtx4090").replace(capability=None, device_name="NVIDIA Next GPU")
    sage = table_plan("flux", unknown, attention="sage")
    assert sage.value("attention_backend") == "sage" and "capability unknown" in sage["attention_backend"].reason
    assert sage.attention_install == "sageattention>=2.1.1 --no-deps"
    matched = table_plan("flux", preset("rtx4090").replace(torch_version="2.8.0+cu128"), attention="xformers")
    # The wheel built for this torch and its CUDA, from PyTorch's index for that CUDA.
    assert matched.attention_install == (
        "xformers==0.0.32.post2 --index-url https://download.pytorch.org/whl/cu128 --no-deps"
    )
    unmatched = table_plan("flux", preset("rtx4090").replace(torch_version="2.99.0"), attention="xformers")
    assert unmatched.value("attention_backend") == "native" and unmatched.attention_install is None
    assert "no xformers wheel" in unmatched["attention_backend"].reason
    from engine.runtime.attention import pip_command

    assert pip_command("sageattention>=2.1.1 --no-deps")[-3:] == ["--only-binary=:all:", "sageattention>=2.1.1", "--no-deps"]


# -- 11. provenance: requested and status on every control -------------------------------


def test_11_every_control_records_requested_and_status() -> None:
    record = cli_plan("--family", "flux", "--hardware", "a100-80g", "--quant", "fp8", "--attention", "sage")
    resolved = record["resolved"]
    for name in CONTROLS:
        assert {"value", "source", "reason", "requested", "status"} <= set(resolved[name]), name  # type: ignore[index]
        assert resolved[name]["status"] in STATUSES  # type: ignore[index]
    fp8 = resolved["transformer_quant"]  # type: ignore[index]
    assert (fp8["requested"], fp8["value"], fp8["status"]) == ("fp8", None, "refused")
    assert resolved["dtype"]["requested"] == "auto" and resolved["dtype"]["status"] == "engaged"  # type: ignore[index]
    t4 = table_plan("flux", "t4", attention="sage")["attention_backend"].to_dict()
    assert (t4["requested"], t4["value"], t4["status"]) == ("sage", "native", "fell back")
    # A control re-decided later keeps what was asked.
    later = table_plan("flux", "rtx4090", attention="sage").with_control("attention_backend", explicit("native", "install failed"))
    assert later["attention_backend"].to_dict()["status"] == "fell back"


# -- 12. Qwen-Image fp8 with the activation-scale floor --------------------------------


def test_12_qwen_image_fp8_inference_needs_and_gets_the_floor() -> None:
    assert table_plan("qwen_image", "h100", quant="fp8").value("transformer_quant") == "fp8"
    no_floor = preset("h100").replace(fp8_activation_floor=False)
    denied = table_plan("qwen_image", no_floor, quant="fp8")["transformer_quant"]
    assert denied.value is None and "black" in denied.reason
    # Training keeps fp8 denied, floor or not.
    spec = REGISTRY.family("qwen_image")
    assert "fp8" in REGISTRY.quant_deny(spec, "training")
    assert training_precision_preflight_error(REGISTRY, spec, preset("h100"), "fp8", base_repo="Qwen/Qwen-Image") is not None


class DeniesFp8ForItsOwnReason:
    """A third-party plugin denying Qwen-Image's fp8 for a reason the floor does not fix."""

    @hookimpl
    def engine_quant_deny(self, family: FamilySpec, purpose: str) -> list[QuantDeny] | None:
        if family.name == "qwen_image" and purpose == "inference":
            return [QuantDeny("fp8", "our fp8 kernels are not validated on this model")]
        return None


def test_12_the_floor_lifts_only_the_tables_own_deny() -> None:
    """The floor lifts the deny Qwen-Image's table made for it, never another plugin's fp8 deny."""
    registry = load_registry(plugins=[("denies-fp8", DeniesFp8ForItsOwnReason())])
    spec = registry.family("qwen_image")
    facts = ModelFacts(spec, spec.default_checkpoint, registry.component_sizes(spec, spec.default_checkpoint))
    planned = plan_inference(registry, facts, preset("h100"), InferenceRequest(quant="fp8"), env=NO_ENV)
    refused = planned["transformer_quant"]
    assert refused.value != "fp8" and "not validated" in refused.reason
    assert "black" not in refused.reason  # the table's own reason is lifted; the other plugin's stands
    assert "lifted" not in refused.reason


def test_12_the_runtime_sets_the_floor_where_torchao_has_it() -> None:
    from engine.runtime.quantize import FP8_ACTIVATION_FLOOR, torchao_config

    assert probe_module.torchao_exposes_fp8_floor()  # the installed torchao (0.18) has it
    config = torchao_config("fp8", "cuda")
    assert config.activation_value_lb == FP8_ACTIVATION_FLOOR == 1e-12  # type: ignore[attr-defined]


# -- 13. CPU RAM counts free swap --------------------------------------------------------


def test_13_cpu_counts_swap_before_refusing() -> None:
    small = preset("cpu").replace(free_memory_gb=12.0)
    with pytest.raises(PreflightError) as raised:
        table_plan("zimage", small)
    assert raised.value.code == "insufficient_memory" and "swap" in raised.value.message
    swapped = table_plan("zimage", small.replace(swap_free_gb=16.0))
    assert swapped.value("memory_mode") == "resident" and "swap" in swapped["memory_mode"].reason


def test_kept_cpu_threads_are_one_per_physical_core_the_earlier_halving_where_unknown() -> None:
    """Kept difference: the earlier cpu_count // 2 gave a 2-core machine without SMT 1 thread."""
    no_smt = preset("cpu").replace(cpu_count=2, physical_cores=2, free_memory_gb=16.0)
    assert table_plan("sdxl", no_smt).value("threads") == 2
    assert table_plan("sdxl", no_smt.replace(cpu_count=16, physical_cores=8)).value("threads") == 8  # SMT: once per core
    assert table_plan("sdxl", no_smt.replace(physical_cores=None)).value("threads") == 1  # unknown: the earlier rule


@pytest.mark.parametrize("mode", ["resident", "model_offload", "group_offload", "sequential_offload"])
def test_13_an_explicit_memory_mode_on_a_cpu_is_refused_beyond_ram_and_swap_too(mode: str) -> None:
    """Every mode keeps the weights in RAM on a CPU, so none gets past the refusal auto gives."""
    small = preset("cpu").replace(free_memory_gb=12.0)
    with pytest.raises(PreflightError) as raised:
        table_plan("zimage", small, memory=mode)
    assert raised.value.code == "insufficient_memory" and f"memory={mode}" in raised.value.message
    assert table_plan("zimage", small.replace(swap_free_gb=16.0), memory=mode).value("memory_mode") == "resident"


def test_12_lifted_denials_name_real_capabilities_and_real_denials() -> None:
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    for spec in REGISTRY.families.values():
        denied = REGISTRY.quant_deny(spec, "inference")
        for scheme, capability in spec.quantisation.deny_lifted_by:
            assert scheme in denied and capability in fields, (spec.name, scheme, capability)
