"""VAE tiling chosen by the plan, engaged per call, and an activation guard
that grows with resolution x batch."""

from __future__ import annotations

from tests.support import table_plan

import torch
from diffusers import AutoencoderKL

from engine.contract.plugins import load_registry
from engine.policy.activations import VAE_TILE_PX
from engine.policy.inference import Plan
from engine.policy.resolved import auto
from engine.runtime.vae import apply_vae_tiling

REGISTRY = load_registry()




def test_the_plan_names_the_size_above_which_the_vae_tiles() -> None:
    small, large = table_plan("sdxl", "rtx-a4000"), table_plan("sdxl", "h100")
    side = small.value("vae_tiling")
    assert isinstance(side, int) and 1024 <= side < 4096
    assert large.value("vae_tiling") > side  # type: ignore[operator]  # more headroom, tiles later
    assert f"{side}x{side}" in small["vae_tiling"].reason
    assert table_plan("sdxl", "h100", vae_tiling="on").value("vae_tiling") == 0
    assert table_plan("sdxl", "h100", vae_tiling="off").value("vae_tiling") is None


def test_the_activation_guard_grows_with_resolution_and_batch() -> None:
    base = table_plan("flux", "h100").estimate.overhead_gb
    big = table_plan("flux", "h100", width=2048, height=2048).estimate.overhead_gb
    batch = table_plan("flux", "h100", width=2048, height=2048, count=4).estimate.overhead_gb
    assert base < big < batch
    assert batch > 4 * (big - 1.2)  # four images' activations, one context


def test_a_large_request_on_a_small_card_is_planned_down_up_front() -> None:
    # 2048 px x4 on a 24 GB card: the activations no longer fit beside the
    # resident int8 denoiser, so the plan moves to a lighter mode before loading.
    at_1024 = table_plan("zimage", "rtx3090")
    at_2048 = table_plan("zimage", "rtx3090", width=2048, height=2048, count=4)
    assert at_1024.value("memory_mode") == "resident"
    assert at_2048.value("memory_mode") != "resident" or at_2048.value("text_encoder_memory") == "streamed"


def tiny_vae(sample_size: int, blocks: int = 2) -> AutoencoderKL:
    """A random AutoencoderKL whose decode is local, so tiled and untiled can agree.

    No mid-block attention (its receptive field is the whole latent) and one
    GroupNorm group (the largest sample per statistic). GroupNorm still
    normalises over what it is given, the whole image untiled and one tile
    tiled; the gap shrinks with the tile's size against its zero-padded border,
    so the tile (``sample_size``, as on a served VAE) is 64 latent pixels.
    """
    torch.manual_seed(0)
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=(8,) * blocks,
        layers_per_block=0,
        latent_channels=4,
        norm_num_groups=1,
        sample_size=sample_size,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


class Pipe:
    """What :func:`apply_vae_tiling` reads of a pipeline: its ``vae``."""

    def __init__(self, vae: AutoencoderKL) -> None:
        self.vae = vae


def test_tiling_engages_only_above_the_size_the_plan_names() -> None:
    # A served VAE declares 1024 px samples; the engine caps its tile at the
    # size the plan's peak assumed. Never decoded here, so full-size config is free.
    vae = tiny_vae(1024, blocks=4)  # latents 1/8 of the image
    named = table_plan("sdxl", "rtx-a4000")
    side = named.value("vae_tiling")
    assert isinstance(side, int) and side % 16 == 0
    assert apply_vae_tiling(Pipe(vae), named, side + 16, side + 16) and vae.use_tiling
    assert (vae.tile_sample_min_size, vae.tile_latent_min_size) == (VAE_TILE_PX, VAE_TILE_PX // 8)
    assert not apply_vae_tiling(Pipe(vae), named, side, side) and not vae.use_tiling
    assert not apply_vae_tiling(Pipe(vae), named, 2 * side, side // 2) and not vae.use_tiling  # same pixels
    assert not apply_vae_tiling(Pipe(vae), table_plan("sdxl", "rtx-a4000", vae_tiling="off"), 4096, 4096)
    assert not vae.use_tiling
    assert apply_vae_tiling(Pipe(vae), table_plan("sdxl", "rtx-a4000", vae_tiling="on"), 64, 64) and vae.use_tiling


def test_the_tiled_decode_the_plan_engages_matches_the_untiled_one() -> None:
    # 128 px tiles (64 latent px) over a 192 px image: 2x2 tiles, stride 48
    # latent px, blended linearly over 32 px. Measured (CPU, float32): max |diff|
    # 0.097 = 0.28 sigma of the image, mean 0.0056 = 0.016 sigma, from GroupNorm
    # statistics per tile and the zero-padded tile borders left inside the blend
    # (other seeds: 0.23-0.43 sigma, 0.016-0.029 sigma). The bounds fail without
    # the blend (overlap 0: max 5.4 sigma, mean 0.072 sigma), at half-size tiles
    # (max 0.65 sigma), and far below a one-latent-pixel misplacement (mean 1.0
    # sigma); a tile-size mismatch between latent and image fails on shape.
    vae = tiny_vae(128)
    pipe = Pipe(vae)
    named = table_plan("sdxl", "cpu").with_control("vae_tiling", auto(160, "test: tile above 160x160"))
    never = named.with_control("vae_tiling", auto(None, "test: never"))
    decodes: list[int] = []  # one entry per decoder forward: per tile when tiled
    vae.decoder.register_forward_pre_hook(lambda _module, _args: decodes.append(1))
    latents = torch.randn(1, 4, 96, 96, generator=torch.Generator().manual_seed(0))

    def decode(width: int, height: int, chosen: Plan) -> tuple[bool, torch.Tensor, int]:
        decodes.clear()
        tiled = apply_vae_tiling(pipe, chosen, width, height)
        with torch.no_grad():
            image = vae.decode(latents[..., : height // 2, : width // 2]).sample
        return tiled, image, len(decodes)

    tiled, image, calls = decode(192, 192, named)
    assert tiled and calls == 4 and image.shape == (1, 3, 192, 192)
    untiled, whole, calls = decode(192, 192, never)
    assert not untiled and calls == 1
    sigma = whole.std().item()
    difference = (image - whole).abs()
    assert difference.max().item() < 0.5 * sigma, difference.max().item() / sigma
    assert difference.mean().item() < 0.05 * sigma, difference.mean().item() / sigma
    # At the named size the engine releases tiling: an 80-latent-pixel decode,
    # which tiling would split, runs the decoder once.
    below, _, calls = decode(160, 160, named)
    assert not below and not vae.use_tiling and calls == 1
