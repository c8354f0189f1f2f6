"""The earlier system's rules, one test each, where the engine departed from
them or nothing proved them. Hardware is faked by presets; where a rule needs
CUDA, the test checks the exact arguments handed to torch / diffusers / torchao."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine
from engine.errors import EngineError
from engine.hardware.presets import preset
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.policy.info import training_info
from engine.policy.resolved import auto
from engine.preflight.model import resolve_model
from engine.runtime.attention import DIFFUSERS_BACKENDS, pip_command, pip_install_wheel
from engine.runtime.session import InferenceSession
from engine.testing.checkpoints import write_gguf
from engine.testing.datasets import write_dataset
from engine.requests.training import TrainingConfig
from engine.training.precision import MachineMismatch, base_transform, machine_error, pinned_sdpa
from engine.training.preflight import TrainingPlan, preflight_training

REGISTRY = load_registry()
DIT = ("flux", "qwen_image", "zimage")
TORCHAO_SCHEMES = ("int8", "fp8", "mxfp8", "nvfp4")


def door_plan(family: str, hardware: str, **request: Any):  # type: ignore[no-untyped-def]
    return Engine(registry=REGISTRY, hardware=preset(hardware)).images.plan(family=family, request=InferenceRequest(**request))


@pytest.fixture()
def compile_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """(module, kwargs) for each module ``torch.compile`` is handed (through
    nn.Module.compile); the call is returned uncompiled so CPU tests stay fast."""
    calls: list[tuple[torch.nn.Module, dict[str, Any]]] = []

    def spy(fn: Any = None, **kwargs: Any) -> Any:
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            calls.append((owner, kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", spy)
    return calls


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), count=1, size=64)


def training_plan(base: Path, data: Path, hardware: Any, **overrides: object) -> TrainingPlan:
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": 64, "steps": 1,
        "lora_rank": 4, **overrides,
    })
    return preflight_training(REGISTRY, config, hardware)


# -- departures ------------------------------------------------------------------


def test_pinned_fbcache_compiles_without_fullgraph() -> None:
    pinned = door_plan("flux", "h100", step_cache="fbcache", speed="default")
    assert pinned.value("step_cache") == "fbcache" and pinned.value("compile") == "regional"
    assert pinned.compile_fullgraph is False
    assert "First-Block-Cache" in pinned["compile"].reason
    # The control: with the cache pinned off, nothing hooks the blocks.
    assert door_plan("flux", "h100", step_cache="off", speed="default").compile_fullgraph is True


def test_session_hands_the_plans_fullgraph_and_dynamic_shapes_to_compile(
    tiny_pipeline: Callable[[str], Path], compile_calls: list[tuple[torch.nn.Module, dict[str, Any]]]
) -> None:
    request = InferenceRequest(compile="on", step_cache="fbcache")
    source = resolve_model(REGISTRY, tiny_pipeline("flux"))
    planned = plan_inference(REGISTRY, source.facts(REGISTRY), preset("cpu"), request)
    session = InferenceSession(REGISTRY, source, planned, request, compile_backend="eager")
    session.load()
    try:
        regions = set(REGISTRY.compile_regions(source.family))
        blocks = [m for m in session.denoiser.modules() if type(m).__name__ in regions]
    finally:
        session.unload()
    assert blocks and [m for m, _ in compile_calls] == blocks
    assert all(c == {"dynamic": True, "fullgraph": False, "backend": "eager"} for _, c in compile_calls)


def test_flash3_is_diffusers_hub_backend_loaded_by_kernels() -> None:
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    names = {b.value for b in AttentionBackendName}
    assert set(DIFFUSERS_BACKENDS.values()) <= names  # every backend we set exists in diffusers
    assert DIFFUSERS_BACKENDS["flash3"] == "_flash_3_hub"
    assert AttentionBackendName("_flash_3_hub") in _HUB_KERNELS_REGISTRY  # fetched by `kernels`
    hopper = preset("h100").replace(attention_packages=("kernels",))
    assert door_plan("flux", "h100", speed="default").value("attention_backend") == "cudnn"  # kernels not installed
    engine = Engine(registry=REGISTRY, hardware=hopper)
    assert engine.images.plan(family="flux", request=InferenceRequest(speed="default")).value("attention_backend") == "flash3"
    missing = door_plan("flux", "h100", attention="flash3")
    assert missing.value("attention_backend") == "flash3" and missing.attention_install == "kernels>=0.12"
    assert door_plan("flux", "rtx4090", attention="flash3").value("attention_backend") == "native"  # sm89


@pytest.mark.parametrize("family", DIT)
def test_training_info_drops_compile_where_nothing_trains(family: str) -> None:
    spec = REGISTRY.family(family)
    t4 = training_info(REGISTRY, spec, preset("t4"))
    assert t4.precision_modes == () and t4.supports_compile is False
    assert training_info(REGISTRY, spec, preset("cpu")).supports_compile is False
    assert training_info(REGISTRY, spec, preset("h100")).supports_compile is True


def _fake_nvidia_smi(bin_dir: Path) -> None:
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 9.0, 81559, 80000'\n", encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_images_info_route_is_torch_free_on_a_gpu_machine(tmp_path: Path) -> None:
    """An nvidia-smi on PATH makes the default probe verify with torch; the
    images-info route must not (tables and the light probe only)."""
    _fake_nvidia_smi(tmp_path)
    code = textwrap.dedent(
        """
        import json, sys
        from starlette.testclient import TestClient
        from engine.server.app import ServerSettings, create_app
        from engine.service.facade import Engine
        client = TestClient(create_app(Engine(), ServerSettings(token="t")), base_url="http://localhost")
        response = client.get("/v1/images/info", headers={"Authorization": "Bearer t"})
        body = response.json()
        print(json.dumps({"status": response.status_code, "torch": "torch" in sys.modules,
                          "vendor": body["hardware"]["vendor"],
                          "bf16": body["families"]["flux"]["resident_gb"]["bf16"]}))
        """
    )
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "status": 200, "torch": False, "vendor": "nvidia", "bf16": 33.8
    }


def test_trainer_rechecks_native_bf16_on_the_card_it_runs_on() -> None:
    def error(name: str, dtype: str = "bf16") -> MachineMismatch | None:
        card = preset(name)
        return machine_error(
            plan_device="cuda", compute_dtype=dtype, family_label="FLUX.1", cuda_available=True,
            vendor=card.vendor, capability=card.capability, torch_reports_bf16=True,  # torch's emulation answer
            device_name=card.device_name,
        )

    refused = error("t4")
    assert refused is not None and refused.code == "no_native_bf16" and "sm75" in refused.message
    assert error("v100") is not None and error("h100") is None and error("rtx3090") is None
    assert error("t4", "fp16") is None  # an fp16 plan (SDXL) runs on a T4
    assert error("mi300x") is None  # ROCm: torch's answer is trusted


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_plan_is_refused_by_the_trainer_before_loading(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    """A plan made for an H100 preset, run by the trainer on this CPU machine."""
    from engine.training.trainer import run_training

    made = training_plan(tiny_pipeline("flux"), dataset, probe(verify=False), device="cpu")
    wrong = dataclasses.replace(made, device="cuda", weight_dtype=auto("bf16", "planned on an H100"))
    events: list[dict[str, object]] = []
    with pytest.raises(MachineMismatch) as raised:
        run_training(wrong, tmp_path / "out", events.append, lambda: None)
    assert raised.value.code == "trainer_machine_mismatch" and "sees none" in raised.value.message
    assert events == []  # refused before the loading phase


def test_default_base_precision_is_auto_and_auto_is_nf4_where_unsure() -> None:
    """Recorded decision: the default is auto (the earlier system's was nf4);
    auto falls back to nf4 wherever it cannot prove a faster mode fits."""
    from engine.policy.training import resolve_training_precision

    assert TrainingConfig.model_fields["base_precision"].default == "auto"
    flux = REGISTRY.family("flux")
    unknown = preset("h100").replace(free_memory_gb=None)
    assert resolve_training_precision(REGISTRY, flux, unknown, "auto").value == "nf4"
    assert resolve_training_precision(REGISTRY, flux, preset("apple-m3-max"), "auto").value == "nf4"


def test_fp8_training_conversion_pads_the_inner_dim() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16)).requires_grad_(False)
    transform, keep = base_transform("fp8")
    transform(model, keep)
    converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert converted and all(m.config.pad_inner_dim for m in converted)


def test_sdxl_info_on_mps_says_where_it_really_trains(
    tiny_pipeline: Callable[[str], Path], dataset: Path
) -> None:
    mac = preset("apple-m3-max")
    note = training_info(REGISTRY, REGISTRY.family("sdxl"), mac).vram_note
    assert "on the CPU" in note and "not on" in note
    assert training_plan(tiny_pipeline("sdxl"), dataset, mac).device == "cpu"


def test_memory_reason_names_the_component_that_does_not_fit() -> None:
    # nf4 shrinks FLUX's transformer below its text encoders: they are what a T4 cannot hold.
    reason = door_plan("flux", "t4", quant="nf4")["memory_mode"].reason
    assert "text encoders alone" in reason and "transformer alone" not in reason
    assert "transformer alone" in door_plan("flux", "t4")["memory_mode"].reason


# -- implemented, now proven -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fp8", "bf16"])
def test_dense_and_fp8_training_arm_regional_compile(
    tiny_pipeline: Callable[[str], Path], dataset: Path, mode: str
) -> None:
    made = training_plan(tiny_pipeline("zimage"), dataset, preset("h100"), base_precision=mode)
    assert made.base_precision.value == mode
    assert made.compile.value == "regional" and made.compile.source == "auto"


def test_training_pins_flash_and_efficient_sdpa_then_restores() -> None:
    backends = torch.backends.cuda
    read = lambda: (  # noqa: E731
        backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(),
        backends.math_sdp_enabled(), backends.cudnn_sdp_enabled(),
    )
    before = read()
    with pinned_sdpa("cuda"):
        assert read() == (True, True, False, False)
    assert read() == before
    with pinned_sdpa("cpu"):
        assert read() == before


def test_trainer_compiles_regions_with_dynamic_shapes(
    tiny_pipeline: Callable[[str], Path], dataset: Path, compile_calls: list[tuple[torch.nn.Module, dict[str, Any]]]
) -> None:
    from diffusers import UNet2DConditionModel

    from engine.training.trainer import _compiled

    made = training_plan(tiny_pipeline("sdxl"), dataset, preset("h100"))
    assert made.compile.value == "regional"  # SDXL compiles its blocks regionally
    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline("sdxl"), subfolder="unet")
    _compiled(made, unet)
    blocks = [m for m in unet.modules() if type(m).__name__ in made.family.speed.compile_regions]
    assert blocks and [m for m, _ in compile_calls] == blocks
    assert all(c == {"dynamic": True} for _, c in compile_calls)


def test_sdxl_compiles_its_blocks_regionally_from_its_table() -> None:
    sdxl = REGISTRY.family("sdxl")
    assert REGISTRY.compile_regions(sdxl) == sdxl.speed.compile_regions != ()
    result = door_plan("sdxl", "h100", speed="default")
    assert result.value("compile") == "regional"
    assert all(region in result["compile"].reason for region in sdxl.speed.compile_regions)
    assert training_info(REGISTRY, sdxl, preset("h100")).supports_compile


def test_gguf_with_int8_quantises_the_bases_dense_transformer(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    from diffusers.quantizers.gguf.utils import GGUFParameter

    base = tiny_pipeline("flux")
    source = resolve_model(REGISTRY, write_gguf(base, "transformer", tmp_path / "t-Q8_0.gguf"), base=base)
    request = InferenceRequest(quant="int8")
    planned = plan_inference(REGISTRY, source.facts(REGISTRY), preset("cpu"), request)
    assert planned.value("transformer_quant") == "int8"
    session = InferenceSession(REGISTRY, source, planned, request)
    session.load()
    try:
        params = list(session.denoiser.parameters())
        assert session.quantised_layers > 0
        assert not any(isinstance(p, GGUFParameter) for p in params)
        assert any(type(p.data).__module__.startswith("torchao") for p in params)
    finally:
        session.unload()


def test_a_torchao_transformer_never_goes_to_group_offload() -> None:
    """Auto memory takes sequential offload; an explicit group_offload is refused."""
    for name in ("rtx3090", "rtx4090", "rtx5090", "l40s", "a100-40g"):
        engine = Engine(registry=REGISTRY, hardware=preset(name))
        for family in REGISTRY.families:
            for scheme in TORCHAO_SCHEMES:
                for memory in ("auto", "group_offload"):
                    try:
                        result = engine.images.plan(family=family, request=InferenceRequest(quant=scheme, memory=memory))
                    except EngineError as exc:  # a refusal keeps the rule
                        assert exc.code in ("incompatible_options", "quant_unsupported", "quant_denied", "does_not_fit"), exc
                        continue
                    if result.value("transformer_quant") in TORCHAO_SCHEMES:
                        assert result.value("memory_mode") != "group_offload", (name, family, scheme, memory)
    with pytest.raises(EngineError) as refused:
        door_plan("flux", "rtx4090", quant="int8", memory="group_offload")
    assert refused.value.code == "incompatible_options" and "sequential_offload" in refused.value.message


def test_attention_install_is_wheel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pip_command("sageattention>=2.1.1 --no-deps") == [
        sys.executable, "-m", "pip", "install", "--only-binary=:all:", "sageattention>=2.1.1", "--no-deps",
    ]
    ran: list[list[str]] = []

    def run(args: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        ran.append(args)
        return subprocess.CompletedProcess(args, 1, "", "no wheel")

    monkeypatch.setattr(subprocess, "run", run)
    assert pip_install_wheel("kernels>=0.12") is False
    assert ran == [pip_command("kernels>=0.12")]
