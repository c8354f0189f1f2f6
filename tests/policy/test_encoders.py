"""Text-encoder precision and streaming: planned with reasons, built on CPU.

The runtime tests use the tiny FLUX pipeline with its T5 widened to 512
features (the inference quantisation filter leaves narrower Linears dense,
as it does on the real models' small layers), so int8 has layers to take.
"""

from __future__ import annotations

from tests.support import table_plan

import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.encoders import encoder_gb
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.model import resolve_model
from engine.runtime.session import GenerateRequest, InferenceSession

REGISTRY = load_registry()




# -- the plan ------------------------------------------------------------------------


@pytest.mark.parametrize(("hw", "scheme"), [("h100", "fp8"), ("rtx3090", "fp8"), ("t4", "none"), ("cpu", "none")])
def test_auto_encoder_scheme_follows_the_machine(hw: str, scheme: str) -> None:
    """``auto`` takes layerwise fp8 wherever a CUDA GPU computes in native bf16 (sm80+: the
    earlier system's "fp8 needs CUDA bf16"), none on a T4 or the CPU."""
    result = table_plan("sdxl" if hw == "cpu" else "flux", hw)
    resolved = result["text_encoder_quant"]
    assert (resolved.value, resolved.source) == (scheme, "auto")
    assert resolved.reason
    shown = result.to_dict()["resolved"]["text_encoder_quant"]  # type: ignore[index]
    assert shown["value"] == scheme and shown["reason"] == resolved.reason


def test_the_encoder_scheme_sizes_the_memory_estimate() -> None:
    fp8 = table_plan("flux", "h100")
    dense = table_plan("flux", "h100", text_encoder_quant="none")
    sizes = REGISTRY.component_sizes(REGISTRY.family("flux"))
    assert fp8.estimate.components.text_encoders_gb == pytest.approx(encoder_gb(sizes.text_encoders_gb, "fp8"))
    assert dense.estimate.components.text_encoders_gb == pytest.approx(sizes.text_encoders_gb)
    assert fp8.estimate.resident_gb < dense.estimate.resident_gb


def test_a_family_deny_list_keeps_its_encoders_dense_with_the_reason() -> None:
    auto = table_plan("sdxl", "h100")["text_encoder_quant"]
    assert auto.value == "none" and "denies" in auto.reason
    asked = table_plan("sdxl", "h100", text_encoder_quant="int8")["text_encoder_quant"]
    assert asked.value == "none" and asked.overridden and "SDXL" in asked.reason


def test_an_unsupported_explicit_scheme_is_downgraded_with_the_capability() -> None:
    asked = table_plan("flux", "rtx3090", text_encoder_quant="fp8_dynamic")["text_encoder_quant"]
    assert asked.value == "none" and "8.9" in asked.reason
    assert table_plan("flux", "h100", text_encoder_quant="fp8_dynamic").value("text_encoder_quant") == "fp8_dynamic"
    t4 = table_plan("flux", "t4", text_encoder_quant="fp8")["text_encoder_quant"]
    assert t4.value == "none" and "native bf16" in t4.reason
    nvfp4 = table_plan("flux", "h100", text_encoder_quant="nvfp4")["text_encoder_quant"]
    assert nvfp4.value == "none" and "Blackwell" in nvfp4.reason
    assert table_plan("flux", "b200", text_encoder_quant="nvfp4").value("text_encoder_quant") == "nvfp4"


def test_torchao_encoder_modes_run_as_layerwise_fp8_where_the_plan_moves_the_encoders() -> None:
    """torchao's modes are tensor subclasses that reject ``Module.to``: under offload (or
    streamed encoders) the plan holds the encoders in layerwise fp8 instead, saying why."""
    offloaded = table_plan("flux", "h100", text_encoder_quant="fp8_dynamic", memory="model_offload")["text_encoder_quant"]
    assert (offloaded.value, offloaded.to_dict()["status"]) == ("fp8", "fell back")
    assert "torchao tensor subclass" in offloaded.reason and "layerwise fp8" in offloaded.reason
    resident = table_plan("flux", "h100", text_encoder_quant="fp8_dynamic")
    assert resident.value("memory_mode") == "resident" and resident.value("text_encoder_quant") == "fp8_dynamic"
    layerwise = table_plan("flux", "h100", text_encoder_quant="fp8", memory="model_offload")["text_encoder_quant"]
    assert layerwise.value == "fp8" and layerwise.to_dict()["status"] == "engaged"


def test_int8_encoders_need_the_familys_keep_in_bf16_schedule_else_fp8_is_the_effective_mode() -> None:
    """The earlier system ran int8 encoders only for a family with a measured keep-in-bf16
    schedule (Qwen-Image has one); elsewhere the record says fp8 is the effective mode."""
    flux = table_plan("flux", "h100", text_encoder_quant="int8")["text_encoder_quant"]
    assert (flux.value, flux.to_dict()["requested"], flux.to_dict()["status"]) == ("fp8", "int8", "fell back")
    assert "schedule" in flux.reason and "fp8 is the effective mode" in flux.reason
    assert REGISTRY.family("qwen_image").quantisation.text_encoder_int8_keep
    assert table_plan("qwen_image", "b200", text_encoder_quant="int8").value("text_encoder_quant") == "int8"


def test_encoders_that_do_not_fit_beside_the_denoiser_are_streamed() -> None:
    result = table_plan("flux", "rtx4090")
    assert result.value("text_encoder_memory") == "streamed"
    assert result.value("memory_mode") == "resident"  # the denoiser is never offloaded
    assert "do not fit beside the denoiser" in result["text_encoder_memory"].reason
    roomy = table_plan("flux", "h100")
    assert roomy.value("text_encoder_memory") == "resident"


def test_streaming_is_refused_beside_an_offloaded_denoiser() -> None:
    asked = table_plan("flux", "h100", memory="model_offload", text_encoder_memory="streamed")
    resolved = asked["text_encoder_memory"]
    assert resolved.value == "resident" and resolved.overridden and "model_offload" in resolved.reason
    assert asked.value("memory_mode") == "model_offload"


def test_host_encoders_are_asked_for_on_a_card_and_mean_nothing_on_one_memory_pool() -> None:
    """``text_encoder_memory=host`` on a card: the encoders counted off it and the rest planned
    resident; on the CPU (one pool) it is resident, saying why."""
    asked = table_plan("flux", "rtx4090", text_encoder_memory="host")
    assert (asked.value("text_encoder_memory"), asked.value("memory_mode")) == ("host", "resident")
    assert asked.estimate.resident_gb < table_plan("flux", "rtx4090", text_encoder_memory="resident").estimate.resident_gb
    cpu = table_plan("sdxl", "cpu", text_encoder_memory="host")["text_encoder_memory"]
    assert cpu.value == "resident" and cpu.overridden and "one memory pool" in cpu.reason


def test_host_encoders_give_their_output_on_the_execution_device(tiny_pipeline: Callable[[str], Path]) -> None:
    """The bridge keeps the weights on the host and hands the output to the device the rest runs
    on, a transformers output kept its own class ("meta" stands in for the card here)."""
    from diffusers import DiffusionPipeline

    from engine.runtime.text_encoders import keep_on_host

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline("wan")))
    assert keep_on_host(pipe, "meta") == ["text_encoder"]
    output = pipe.text_encoder(torch.ones(1, 4, dtype=torch.long))
    from transformers.utils import ModelOutput

    assert isinstance(output, ModelOutput)  # its own class, not a plain dict
    assert output.last_hidden_state.device.type == "meta"
    assert next(pipe.text_encoder.parameters()).device.type == "cpu"


def test_a_bad_encoder_request_is_refused_naming_the_field() -> None:
    from engine.errors import PreflightError

    with pytest.raises(PreflightError, match="text_encoder_quant"):
        table_plan("flux", "h100", text_encoder_quant="int4")


# -- the runtime on CPU ----------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_t5_flux(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX pipeline with a 512-wide T5 (and a context embedder to match)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from transformers import T5EncoderModel

    pipe = FluxPipeline.from_pretrained(tiny_pipeline("flux"))
    config = pipe.text_encoder_2.config.to_dict()
    config.update(d_model=512, d_kv=64, num_heads=8, d_ff=512)
    torch.manual_seed(0)
    pipe.text_encoder_2 = T5EncoderModel(type(pipe.text_encoder_2.config)(**config)).eval()
    torch.manual_seed(0)
    pipe.transformer = FluxTransformer2DModel.from_config({**pipe.transformer.config, "joint_attention_dim": 512})
    folder = tmp_path_factory.mktemp("wide-t5") / "flux"
    pipe.save_pretrained(folder)
    return folder


def load(folder: Path, **request: object) -> InferenceSession:
    asked = InferenceRequest(quant="none", **request)  # type: ignore[arg-type]
    source = resolve_model(REGISTRY, folder)
    session = InferenceSession(REGISTRY, source, plan_inference(REGISTRY, source.facts(REGISTRY), probe(verify=False), asked), asked)
    session.load()
    return session


def image(session: InferenceSession) -> np.ndarray:
    [result] = session.generate(GenerateRequest("a lighthouse at dusk", steps=1, seed=3, width=32, height=32))
    return np.asarray(result).astype(np.int16)


@pytest.fixture(scope="module")
def reference(wide_t5_flux: Path) -> np.ndarray:
    """The image with dense, resident encoders."""
    dense = load(wide_t5_flux)
    try:
        return image(dense)
    finally:
        dense.unload()


def test_a_layerwise_fp8_text_encoder_generates_on_cpu(wide_t5_flux: Path, reference: np.ndarray) -> None:
    """FLUX has no int8 schedule: an int8 request runs as layerwise fp8 (weights stored in
    e4m3, upcast per layer: plain tensors), which the CPU runs too."""
    session = load(wide_t5_flux, text_encoder_quant="int8")
    try:
        resolved = session.plan["text_encoder_quant"]
        assert (resolved.value, resolved.source, resolved.requested) == ("fp8", "explicit", "int8")
        t5 = session.pipeline.text_encoder_2
        stored = [m for m in t5.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float8_e4m3fn]
        assert all(type(m.weight) is torch.nn.Parameter for m in stored)  # no tensor subclass
        [placement] = session.status()["text_encoders"]["placements"]  # type: ignore[index]
        assert placement["layers"] == len(stored) > 0  # the 32-wide CLIP has none: it stays dense
        result = image(session)
    finally:
        session.unload()
    assert result.shape == reference.shape
    assert np.abs(result - reference).mean() < 8  # e4m3 weights: close to the dense encoder


def test_an_int8_text_encoder_with_a_schedule_keeps_its_scheduled_layers_dense_on_cpu(
    wide_t5_flux: Path, reference: np.ndarray
) -> None:
    """A family with a keep-in-bf16 schedule gets torchao weight-only int8 encoders, the
    scheduled Linears left dense (here FLUX given a schedule keeping T5's attention)."""
    import dataclasses

    flux = REGISTRY.family("flux")
    scheduled = dataclasses.replace(flux, quantisation=dataclasses.replace(
        flux.quantisation, text_encoder_int8_keep=("SelfAttention",)))
    asked = InferenceRequest(quant="none", text_encoder_quant="int8")
    source = dataclasses.replace(resolve_model(REGISTRY, wide_t5_flux), family=scheduled)
    session = InferenceSession(REGISTRY, source, plan_inference(REGISTRY, source.facts(REGISTRY), probe(verify=False),
                                                                asked), asked)
    session.load()
    try:
        assert session.plan.value("text_encoder_quant") == "int8"
        t5 = session.pipeline.text_encoder_2
        linears = {n: m for n, m in t5.named_modules() if isinstance(m, torch.nn.Linear)}
        quantised = {n for n, m in linears.items() if type(m.weight) is not torch.nn.Parameter}
        assert quantised and all("SelfAttention" not in n for n in quantised)
        assert any("SelfAttention" in n for n in linears)  # there were some to keep
        result = image(session)
    finally:
        session.unload()
    assert np.abs(result - reference).mean() < 8


def test_streamed_encoders_are_freed_before_denoising_and_reloaded(wide_t5_flux: Path, reference: np.ndarray) -> None:
    session = load(wide_t5_flux, text_encoder_memory="streamed", prompt_cache=False)  # every call encodes
    seen: list[tuple[bool, bool]] = []
    try:
        assert session.plan.value("text_encoder_memory") == "streamed"
        pipe = session.pipeline
        encoders = [weakref.ref(pipe.text_encoder), weakref.ref(pipe.text_encoder_2)]

        def at_denoise(_module: torch.nn.Module, _args: object) -> None:
            if not seen:
                seen.append((pipe.text_encoder is None and pipe.text_encoder_2 is None,
                             all(ref() is None for ref in encoders)))

        hook = session.denoiser.register_forward_pre_hook(at_denoise)
        first = image(session)
        again = image(session)
        hook.remove()
        stream = session.status()["text_encoders"]["stream"]  # type: ignore[index]
    finally:
        session.unload()
    assert seen == [(True, True)]  # gone, and garbage, when the denoiser first runs
    assert stream["loads"] == 2 and stream["frees"] == 2  # type: ignore[index]
    assert np.array_equal(first, reference) and np.array_equal(again, reference)


def test_info_lists_the_encoders_size_per_allowed_scheme() -> None:
    from engine.policy.info import images_info

    flux = images_info(REGISTRY, REGISTRY.family("flux")).to_dict()
    assert flux["text_encoders_gb"]["fp8"] < flux["text_encoders_gb"]["none"] == 9.8  # type: ignore[index]
    sdxl = images_info(REGISTRY, REGISTRY.family("sdxl")).to_dict()
    assert list(sdxl["text_encoders_gb"]) == ["none"] and "fp8_dynamic" in sdxl["text_encoder_denied"]  # type: ignore[arg-type,operator]
