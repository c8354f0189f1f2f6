"""A family's latent geometry decides every token count and latent size the engine uses.

The built-in families keep the DiTs' shape (8x VAE, patch 2: 16-pixel tokens); a family
whose VAE compresses 32x with no patching (Sana's DC-AE) is one line in its table, and the
training estimate, the activation guard, the flow shift and the memory tool follow it.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.contract.plugins import load_registry
from engine.contract.types import ActivationFigures, FamilySpec, LatentGeometry, LoraTargetShape, TrainingMemoryFigures
from engine.policy.activations import ImageShape, denoiser_activation_gb, resolve_vae_tiling
from engine.policy.training_memory import BaseFacts, TrainingShape, estimate_training_memory
from engine.training.levers import resolution_shift

REGISTRY = load_registry()
DC_AE = LatentGeometry(spatial_compression=32, patch_size=1)


def deep_vae(family: FamilySpec) -> FamilySpec:
    """``family`` with a 32x VAE and no patching, its figures as measured per token."""
    return dataclasses.replace(family, rendering=dataclasses.replace(family.rendering, geometry=DC_AE))


def test_the_default_geometry_is_the_dits_and_every_built_in_family_keeps_it() -> None:
    geometry = LatentGeometry()
    assert (geometry.spatial_compression, geometry.patch_size, geometry.token_pixels) == (8, 2, 16)
    assert geometry.image_tokens(1024) == 4096 and geometry.image_tokens(1024, 512) == 2048
    assert geometry.latent_side(1024) == 128
    images = [f for f in REGISTRY.families.values() if f.rendering.output == "images"]
    own = {"flux2", "qwen_image21", "ideogram4", "flux3", "hunyuan_image"}  # their VAEs say their own
    assert images and {(f.rendering.geometry.spatial_compression, f.rendering.geometry.patch_size)
                       for f in images if f.name not in ("qwen_image21", "hunyuan_image")} == {(8, 2)}
    assert {f.rendering.geometry for f in images if f.name not in own} == {geometry}
    for name in ("flux2", "ideogram4", "flux3"):  # FLUX.2's VAE says its own channels
        assert REGISTRY.family(name).rendering.geometry.latent_channels == 32
    # HunyuanImage 2.1's 32x VAE, read unpatched: a token is 32 px, a quarter of a DiT's tokens.
    hunyuan = REGISTRY.family("hunyuan_image").rendering
    assert (hunyuan.geometry.token_pixels, hunyuan.sides, hunyuan.geometry.image_tokens(1024)) == (32, 32, 1024)
    # Qwen-Image 2.1's 16x VAE, read unpatched: a token is 16 px as for the DiTs, its sides multiples of 32.
    qwen21 = REGISTRY.family("qwen_image21").rendering
    assert (qwen21.geometry.token_pixels, qwen21.sides, qwen21.geometry.image_tokens(1024)) == (16, 32, 4096)
    # The video families say their VAE's own: 4x in time, Wan 2.1's 8x and HunyuanVideo's 16x / patch 1.
    assert REGISTRY.family("wan").rendering.geometry.temporal_compression == 4
    assert REGISTRY.family("hunyuan_video").rendering.geometry.token_pixels == 16


def test_a_32x_vae_with_patch_1_has_a_quarter_of_the_tokens() -> None:
    assert DC_AE.token_pixels == 32 and DC_AE.latent_side(1024) == 32
    assert DC_AE.image_tokens(1024) == 1024 == LatentGeometry().image_tokens(1024) // 4


@pytest.mark.parametrize("field", ["spatial_compression", "patch_size", "temporal_compression"])
@pytest.mark.parametrize("value", [0, -8, True, 2.5])
def test_a_geometry_that_is_not_whole_positive_numbers_is_refused_in_the_table(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"LatentGeometry.{field}"):
        LatentGeometry(**{field: value})  # type: ignore[arg-type]


def test_the_training_estimate_counts_the_familys_tokens() -> None:
    """Same figures, same base: a 32x/patch-1 family keeps a quarter of the image-token activations."""
    flux = REGISTRY.family("flux")
    base = BaseFacts(flux.training.dense_gb, flux.sizes.text_encoders_gb, flux.sizes.vae_gb)
    shape = TrainingShape(resolution=1024, batch_size=1, lora_rank=16, gradient_checkpointing=False)
    figures = flux.training.memory.activations  # type: ignore[union-attr]
    dits = estimate_training_memory(flux, base, "bf16", shape).activations_gb
    deep = estimate_training_memory(deep_vae(flux), base, "bf16", shape).activations_gb
    image = figures.block_per_image_token * figures.blocks + figures.outside_per_image_token
    text = (figures.block_per_text_token * figures.blocks + figures.outside_per_text_token) * figures.text_tokens
    # elements per sample = image figure x tokens + text part; the bytes ratio follows the token counts
    assert deep / dits == pytest.approx((image * 1024 + text) / (image * 4096 + text), rel=1e-6)
    assert deep < dits / 2


def test_the_activation_guard_and_the_vae_tiling_snap_follow_the_geometry() -> None:
    flux = REGISTRY.family("flux")
    shape = ImageShape(1024, 1024)
    assert shape.image_tokens(LatentGeometry()) == 4096 and shape.image_tokens(DC_AE) == 1024
    assert denoiser_activation_gb(deep_vae(flux), shape, 2) < denoiser_activation_gb(flux, shape, 2)
    side = resolve_vae_tiling(deep_vae(flux), 7.0, 2).value
    assert isinstance(side, int) and side % 32 == 0 and side > 0


def test_the_flow_shift_by_resolution_reads_the_familys_token_count() -> None:
    qwen = REGISTRY.family("qwen_image")
    defaults = qwen.training.defaults
    assert defaults is not None
    shift_dits = resolution_shift(defaults, 1024, qwen.rendering.geometry)
    shift_deep = resolution_shift(defaults, 1024, DC_AE)
    assert shift_deep < shift_dits  # fewer tokens: the schedule shifts less
    # 2048 px at 32 px a token is the 4096 tokens 1024 px is at 16 px a token: the same shift
    assert resolution_shift(defaults, 2048, DC_AE) == pytest.approx(resolution_shift(defaults, 1024, LatentGeometry()))


@pytest.mark.slow
def test_the_memory_tool_feeds_the_denoiser_latents_of_the_familys_compression() -> None:
    """Measured under fake tensors, a 32x family's step at 256 px is a 16x16-pixel family's at 64 px:
    the tool builds its latents from the geometry, not from an 8x VAE."""
    from engine.testing import memory_figures

    flux = REGISTRY.family("flux")
    dits = memory_figures.Denoiser.of(flux)
    deep = memory_figures.Denoiser.of(dataclasses.replace(flux, rendering=dataclasses.replace(flux.rendering, geometry=LatentGeometry(32, 2))))
    at_64, _ = memory_figures.measure_step(dits, dits.narrow, 64, 32, False)
    at_256, _ = memory_figures.measure_step(deep, deep.narrow, 256, 32, False)
    at_256_dits, _ = memory_figures.measure_step(dits, dits.narrow, 256, 32, False)
    assert at_256.activations_peak == at_64.activations_peak  # the same 8x8-cell latent
    assert at_256.activations_peak < at_256_dits.activations_peak


# -- the Sana case: a family whose geometry differs, measured ---------------------------------

#: tests/sana_probe.py's figures, as `python -m engine.testing.memory_figures --derive` printed them.
SANA_FIGURES = TrainingMemoryFigures(
    activations=ActivationFigures(
        block_per_image_token=105936.0, block_per_text_token=13504.0,
        checkpointed_block_per_image_token=2240.0, checkpointed_block_per_text_token=0.0,
        outside_per_image_token=10119.7, outside_per_text_token=1120.0, blocks=20, text_tokens=300,
        checkpointed_outside_per_image_token=11360.0, checkpointed_outside_per_text_token=2240.0,
    ),
    lora_targets=tuple(LoraTargetShape(name, 2240, 2240, 40) for name in ("to_k", "to_out.0", "to_q", "to_v")),
)


def test_a_sana_lora_run_is_sized_from_its_own_tokens_not_an_8x_vae() -> None:
    """The dry run's estimate for 1024 px on a 24 GB card: about 8 GB (Sana's 1024 tokens), not the
    74 GB an 8x / patch-2 reading gave, so gradient checkpointing is not forced and bf16 runs."""
    from engine.hardware.presets import PRESETS
    from engine.policy.training import MemoryRequest, training_precision_preflight_error
    from tests.sana_probe import sana_family

    sana = sana_family(SANA_FIGURES)
    base = BaseFacts(sana.training.dense_gb, sana.sizes.text_encoders_gb, sana.sizes.vae_gb)
    shape = TrainingShape(resolution=1024, batch_size=1, lora_rank=16, gradient_checkpointing=False)
    estimate = estimate_training_memory(sana, base, "bf16", shape)
    assert sana.rendering.geometry.image_tokens(1024) == 1024
    assert 4.0 < estimate.activations_gb < 6.0 and estimate.training_peak_gb < 12.0, estimate
    memory = MemoryRequest(base, shape)
    registry = REGISTRY
    assert training_precision_preflight_error(registry, sana, PRESETS["rtx4090"], "bf16", memory=memory) is None


@pytest.mark.slow
def test_the_sana_estimate_is_within_ten_percent_of_a_measured_step() -> None:
    """A full-size Sana 1.6B LoRA step at 1024 px, measured under fake tensors (every op at its real
    shape, bytes counted), against the engine's estimate from the family's figures: within 10%."""
    from engine.testing import memory_figures
    from tests.sana_probe import sana_family

    d = memory_figures.Denoiser.of(sana_family(SANA_FIGURES))
    lines: list[str] = []
    errors = memory_figures.check(d, "full", (1024,), lines.append)
    assert len(errors) == 4 and max(errors) < 10.0, "\n".join(lines)
