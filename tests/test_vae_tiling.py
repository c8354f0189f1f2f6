"""VAE tiling chosen by the plan, engaged per call, and an activation guard
that grows with resolution x batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.hardware.presets import PRESETS
from engine.plugins import load_registry
from engine.policy.inference import InferenceRequest, ModelFacts, Plan, plan_inference
from engine.policy.resolved import auto
from engine.runtime.vae import apply_vae_tiling

REGISTRY = load_registry()


def plan(family: str, hw: str, **request: object) -> Plan:
    spec = REGISTRY.family(family)
    facts = ModelFacts(spec, spec.default_checkpoint, REGISTRY.component_sizes(spec))
    return plan_inference(REGISTRY, facts, PRESETS[hw], InferenceRequest(**request), env={})  # type: ignore[arg-type]


def test_the_plan_names_the_size_above_which_the_vae_tiles() -> None:
    small, large = plan("sdxl", "rtx-a4000"), plan("sdxl", "h100")
    side = small.value("vae_tiling")
    assert isinstance(side, int) and 1024 <= side < 4096
    assert large.value("vae_tiling") > side  # type: ignore[operator]  # more headroom, tiles later
    assert f"{side}x{side}" in small["vae_tiling"].reason
    assert plan("sdxl", "h100", vae_tiling="on").value("vae_tiling") == 0
    assert plan("sdxl", "h100", vae_tiling="off").value("vae_tiling") is None


def test_the_activation_guard_grows_with_resolution_and_batch() -> None:
    base = plan("flux", "h100").estimate.overhead_gb
    big = plan("flux", "h100", width=2048, height=2048).estimate.overhead_gb
    batch = plan("flux", "h100", width=2048, height=2048, count=4).estimate.overhead_gb
    assert base < big < batch
    assert batch > 4 * (big - 1.2)  # four images' activations, one context


def test_a_large_request_on_a_small_card_is_planned_down_up_front() -> None:
    # 2048 px x4 on a 24 GB card: the activations no longer fit beside the
    # resident int8 denoiser, so the plan moves to a lighter mode before loading.
    at_1024 = plan("zimage", "rtx3090")
    at_2048 = plan("zimage", "rtx3090", width=2048, height=2048, count=4)
    assert at_1024.value("memory_mode") == "resident"
    assert at_2048.value("memory_mode") != "resident" or at_2048.value("text_encoder_memory") == "streamed"


@pytest.fixture(scope="module")
def tiny_vae(tiny_pipeline: Callable[[str], Path]) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(tiny_pipeline("flux"), subfolder="vae").eval()


def test_tiling_engages_only_above_the_named_size(tiny_vae: torch.nn.Module) -> None:
    class Pipe:
        vae = tiny_vae

    named = plan("sdxl", "cpu").with_control("vae_tiling", auto(48, "test: tile above 48x48"))
    assert apply_vae_tiling(Pipe, named, 64, 64) and tiny_vae.use_tiling
    assert not apply_vae_tiling(Pipe, named, 48, 48) and not tiny_vae.use_tiling
    never = named.with_control("vae_tiling", auto(None, "test: never"))
    assert not apply_vae_tiling(Pipe, never, 4096, 4096) and not tiny_vae.use_tiling


def test_a_tiled_decode_goes_through_tiles_and_keeps_the_shape(tiny_vae: torch.nn.Module) -> None:
    # A random-weight VAE at 4-latent-pixel tiles is dominated by its borders
    # (every pixel is within a 3x3 conv stack's reach of a seam), so this checks
    # the tiled path runs and keeps the image's shape and range, not pixel equality.
    torch.manual_seed(0)
    latents = torch.randn(1, tiny_vae.config.latent_channels, 8, 8) * 0.5
    with torch.no_grad():
        tiny_vae.disable_tiling()
        whole = tiny_vae.decode(latents).sample
        tiny_vae.enable_tiling()
        tiny_vae.tile_sample_min_size, tiny_vae.tile_latent_min_size = 32, 4  # 2x2 tiles, overlapping
        tiled = tiny_vae.decode(latents).sample
        tiny_vae.disable_tiling()
    assert tiled.shape == whole.shape == (1, 3, 64, 64)
    assert not torch.equal(tiled, whole)  # it really went through the tiled path
    assert torch.isfinite(tiled).all() and tiled.abs().max() < 10 * whole.abs().max()
