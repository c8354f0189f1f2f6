"""The sdxl plugin: the contract, and the UNet trainer's exemptions."""

from engine.hardware.presets import PRESETS, preset
from engine.contract.plugins import Registry
from engine.policy.info import training_info
from engine.policy.training import training_precision_preflight_error
from engine.testing import FamilyContract


class TestSdxlContract(FamilyContract):
    family_name = "sdxl"


def test_sdxl_ignores_base_precision(engine_registry: Registry) -> None:
    """Its trainer holds the UNet in the training dtype: auto is fine, and a leftover
    explicit base precision never fails the run (the plan notes it is ignored)."""
    sdxl = engine_registry.family("sdxl")
    for mode in ("auto", "nf4", "bf16", "int8", "fp8", "mxfp8"):
        assert training_precision_preflight_error(engine_registry, sdxl, preset("t4"), mode) is None


def test_sdxl_is_trainable_without_bf16_and_has_no_selector(engine_registry: Registry) -> None:
    sdxl = engine_registry.family("sdxl")
    for name in ("t4", "v100", "rtx2080ti", "h100"):
        info = training_info(engine_registry, sdxl, PRESETS[name])
        assert info.trainable and info.precision_modes == () and info.supports_compile


def test_sdxl_still_refuses_unknown_mode_names(engine_registry: Registry) -> None:
    sdxl = engine_registry.family("sdxl")
    error = training_precision_preflight_error(engine_registry, sdxl, preset("h100"), "fp4")
    assert error is not None and error.code == "invalid_base_precision"
