"""Training precision policy: every preset x family x mode, and each refusal's code."""

from __future__ import annotations

import itertools

import pytest

from engine.hardware.presets import PRESETS, preset
from engine.contract.plugins import Registry, load_registry
from engine.policy.info import training_info
from engine.policy.training import (
    MemoryRequest,
    resolve_training_precision,
    training_precision_preflight_error,
)
from engine.policy.training_memory import TrainingShape
from engine.contract.types import TRAINING_PRECISIONS

REGISTRY = load_registry()
DIT = ("flux", "qwen_image", "zimage")


def refusal(family: str, hw: str, mode: str, **kwargs: object) -> str | None:
    hardware = PRESETS[hw] if isinstance(hw, str) else hw
    error = training_precision_preflight_error(
        REGISTRY, REGISTRY.family(family), hardware, mode, **kwargs  # type: ignore[arg-type]
    )
    return error.code if error else None


@pytest.mark.parametrize(
    ("hw", "family"), list(itertools.product(sorted(PRESETS), sorted(REGISTRY.families)))
)
def test_info_advertises_exactly_what_the_preflight_accepts(hw: str, family: str) -> None:
    spec = REGISTRY.family(family)
    info = training_info(REGISTRY, spec, PRESETS[hw])
    for mode in TRAINING_PRECISIONS:
        # info sizes each mode at the default shape (512px, batch 1) from the table
        memory = MemoryRequest.from_table(spec, TrainingShape(gradient_checkpointing=None))
        accepted = refusal(family, hw, mode, memory=memory) is None
        if spec.training.base_precision_applies:
            assert (mode in info.precision_modes) == accepted, (hw, family, mode)
        else:
            # No selector to offer; every value is accepted where the family trains (a leftover
            # explicit one is ignored with a note, as the earlier system did).
            assert info.precision_modes == () and accepted == info.trainable
    if info.precision_modes:
        assert info.recommended_precision in info.precision_modes
        assert "fp8" != info.recommended_precision != "mxfp8"


@pytest.mark.parametrize(("hw", "family", "mode"), list(itertools.product(("t4", "v100", "rtx2080ti"), DIT, TRAINING_PRECISIONS)))
def test_dit_training_without_native_bf16_is_refused_in_every_mode(hw: str, family: str, mode: str) -> None:
    assert refusal(family, hw, mode) == "no_native_bf16"


@pytest.mark.parametrize("family", DIT)
def test_t4_info_says_why_dit_families_cannot_train(family: str) -> None:
    info = training_info(REGISTRY, REGISTRY.family(family), preset("t4"))
    assert info.precision_modes == () and not info.trainable
    assert "native bf16" in info.vram_note and "Tesla T4" in info.vram_note


def test_emulated_bf16_on_rocm_is_trusted_when_torch_says_so() -> None:
    mi300x = preset("mi300x")
    assert refusal("flux", "mi300x", "bf16") is None
    no_bf16 = mi300x.replace(native_bf16=False)
    assert refusal("flux", no_bf16, "bf16") == "no_native_bf16"


@pytest.mark.parametrize("mode", TRAINING_PRECISIONS)
def test_any_accelerator_clears_the_gate_and_a_non_cuda_one_trains_a_4_bit_base(mode: str) -> None:
    """The earlier system's later rule (FACTS.md, Training gates): any accelerator clears
    the "no accelerator" gate; a non-CUDA accelerator (MPS, XPU) satisfies the 4-bit load,
    so nf4 and auto pass there while the CUDA-only dense modes stay refused. A plain CPU
    machine has no accelerator at all."""
    assert refusal("flux", "cpu", mode) == "needs_cuda"
    on_mac = refusal("zimage", "apple-m3-max", mode)
    assert on_mac == (None if mode in ("nf4", "auto") else "needs_cuda"), on_mac


def test_device_cpu_runs_dense_modes_and_refuses_gpu_only_ones() -> None:
    assert refusal("flux", "cpu", "bf16", device="cpu") is None
    assert refusal("flux", "cpu", "int8", device="cpu") is None
    assert refusal("flux", "cpu", "auto", device="cpu") is None
    assert refusal("flux", "cpu", "nf4", device="cpu") == "needs_cuda"
    assert refusal("flux", "cpu", "fp8", device="cpu") == "fp8_unsupported"
    assert refusal("flux", "cpu", "mxfp8", device="cpu") == "mxfp8_unsupported"
    assert refusal("flux", "cpu", "bf16", device="cuda") == "needs_cuda"


def test_int8_needs_functional_torchao() -> None:
    stub = preset("h100").replace(torchao_functional=False)
    assert refusal("flux", stub, "int8") == "torchao_unavailable"
    assert refusal("flux", stub, "bf16") is None
    info = training_info(REGISTRY, REGISTRY.family("flux"), stub)
    assert "int8" not in info.precision_modes and "bf16" in info.precision_modes


def test_auto_never_picks_int8_without_torchao() -> None:
    stub = preset("h100").replace(torchao_functional=False, free_memory_gb=30.0)
    resolved = resolve_training_precision(REGISTRY, REGISTRY.family("flux"), stub, "auto")
    assert resolved.value == "nf4" and "torchao" in resolved.reason


def test_nf4_needs_usable_bitsandbytes() -> None:
    no_bnb = preset("h100").replace(bitsandbytes_usable=False)
    assert refusal("flux", no_bnb, "nf4") == "bitsandbytes_unavailable"
    assert refusal("flux", no_bnb.replace(free_memory_gb=10.0), "auto") == "bitsandbytes_unavailable"


@pytest.mark.parametrize(("hw", "fp8", "mxfp8"), [("rtx3090", False, False), ("a100-80g", False, False), ("rtx4090", True, False), ("h100", True, False), ("b200", True, True)])
def test_fp8_and_mxfp8_follow_capability(hw: str, fp8: bool, mxfp8: bool) -> None:
    assert (refusal("flux", hw, "fp8") is None) is fp8
    assert (refusal("zimage", hw, "mxfp8") is None) is mxfp8
    if not fp8:
        assert refusal("flux", hw, "fp8") == "fp8_unsupported"
    if not mxfp8:
        assert refusal("zimage", hw, "mxfp8") == "mxfp8_unsupported"


def test_family_deny_refuses_with_the_measured_reason() -> None:
    assert refusal("qwen_image", "b200", "fp8") == "quant_denied"
    assert refusal("qwen_image", "b200", "mxfp8") == "quant_denied"
    assert refusal("qwen_image", "b200", "int8") is None
    assert refusal("flux", "b200", "fp8") is None


@pytest.mark.parametrize(
    ("family", "repo", "base"),
    [
        ("qwen_image", "diffusers/qwen-image-bnb-4bit", "Qwen/Qwen-Image"),
        ("zimage", "someone/Z-Image-Turbo-bnb-4bit", "Tongyi-MAI/Z-Image-Turbo"),
        ("flux", "someone/FLUX.1-dev-nf4", "black-forest-labs/FLUX.1-dev"),
    ],
)
def test_prequantised_repo_trains_nf4_only_and_names_the_dense_base(family: str, repo: str, base: str) -> None:
    spec = REGISTRY.family(family)
    error = training_precision_preflight_error(REGISTRY, spec, preset("h100"), "bf16", base_repo=repo)
    assert error is not None and error.code == "prequantised_base" and base in error.message
    assert refusal(family, "h100", "nf4", base_repo=repo) is None
    resolved = resolve_training_precision(REGISTRY, spec, preset("h100"), "auto", base_repo=repo)
    assert resolved.value == "nf4" and resolved.source == "auto"


def test_fp16_mixed_precision_refused_on_bf16_families_only() -> None:
    assert refusal("zimage", "h100", "bf16", mixed_precision="fp16") == "fp16_on_bf16_family"
    assert refusal("sdxl", "t4", "auto", mixed_precision="fp16") is None


def test_unknown_mode_and_device_are_refused_by_name() -> None:
    assert refusal("flux", "h100", "int4") == "invalid_base_precision"
    assert refusal("flux", "h100", "bf16", device="tpu") == "invalid_device"


@pytest.mark.parametrize(("free", "expected"), [(None, "nf4"), (10.0, "nf4"), (14.5, "int8"), (19.0, "bf16")])
def test_auto_bands_for_zimage(free: float | None, expected: str) -> None:
    hw = preset("rtx4090").replace(free_memory_gb=free)
    resolved = resolve_training_precision(REGISTRY, REGISTRY.family("zimage"), hw, "auto")
    assert resolved.value == expected and resolved.source == "auto" and resolved.reason


def test_explicit_precision_is_recorded_as_explicit(engine_registry: Registry) -> None:
    resolved = resolve_training_precision(engine_registry, engine_registry.family("flux"), preset("h100"), "int8")
    assert (resolved.value, resolved.source) == ("int8", "explicit")
