"""The qwen_image plugin: the contract, and the measured deny lists."""

from engine.hardware.presets import PRESETS, preset
from engine.contract.plugins import Registry
from engine.policy.info import training_info
from engine.policy.training import training_precision_preflight_error
from engine.testing import FamilyContract


class TestQwenImageContract(FamilyContract):
    family_name = "qwen_image"


class TestQwenImageEdit2511Contract(FamilyContract):
    """The multi-image Edit-2511 (QwenImageEditPlusPipeline, its processor) runs the kit on its own
    tiny pipeline: text-to-image through the base pipeline over its weights, a LoRA trained and
    reloaded (its two-image edit equals plain diffusers' in tests/runtime/test_multi_image_edit.py)."""

    family_name = "qwen_image"
    checkpoint_name = "qwen-image-edit-2511"


def test_qwen_image_denies_fp8_family_for_inference_with_measured_reasons(
    engine_registry: Registry,
) -> None:
    qwen = engine_registry.family("qwen_image")
    denied = engine_registry.quant_deny(qwen, "inference")
    assert set(denied) == {"fp8", "mxfp8", "nvfp4"}
    assert "black" in denied["fp8"] and "0.016" in denied["fp8"]
    assert "0.0146" in denied["mxfp8"]
    assert "0.51" in denied["nvfp4"]
    assert "int8" not in denied


def test_qwen_image_never_advertises_fp8_training(engine_registry: Registry) -> None:
    qwen = engine_registry.family("qwen_image")
    for hardware in PRESETS.values():
        assert "fp8" not in training_info(engine_registry, qwen, hardware).precision_modes
    error = training_precision_preflight_error(engine_registry, qwen, preset("h100"), "fp8")
    assert error is not None and error.code == "quant_denied"
    assert "black" in error.message


def test_qwen_image_is_not_fp16_safe(engine_registry: Registry) -> None:
    qwen = engine_registry.family("qwen_image")
    assert not qwen.precision.fp16_safe() and "black" in qwen.precision.fp16_reason()


def test_qwen_image_bnb_repo_names_its_dense_base(engine_registry: Registry) -> None:
    qwen = engine_registry.family("qwen_image")
    assert engine_registry.dense_base(qwen, "diffusers/qwen-image-bnb-4bit") == "Qwen/Qwen-Image"
    assert engine_registry.dense_base(qwen, "someone/Qwen-Image-Edit-nf4") == "Qwen/Qwen-Image-Edit"
    assert engine_registry.dense_base(qwen, "Qwen/Qwen-Image") is None
