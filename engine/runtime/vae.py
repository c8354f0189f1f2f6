"""VAE tiling and slicing per call, as the plan's ``vae_tiling`` / ``vae_slicing`` say.

The plan names the image side above which an untiled decode would not fit
(see :mod:`engine.policy.activations`); every call compares its own size
with it, so a small image decodes whole (no seams, no tiling cost) and a
large one in tiles no larger than the tile the plan sized.
"""

from __future__ import annotations

from typing import Any

from engine.policy.activations import DEFAULT_SIDE_PX, VAE_TILE_PX


def apply_vae_tiling(pipe: Any, plan: Any, width: int | None, height: int | None) -> bool:
    """Engage or release tiling (and slicing) on ``pipe``'s VAE for one call; True when tiled."""
    vae = getattr(pipe, "vae", None)
    controls = plan.controls
    if vae is None or "vae_tiling" not in controls:
        return False
    if "vae_slicing" in controls and controls["vae_slicing"].value and hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
    side = controls["vae_tiling"].value
    pixels = (width or DEFAULT_SIDE_PX) * (height or DEFAULT_SIDE_PX)
    tiled = side is not None and pixels > int(side) ** 2
    if tiled and hasattr(vae, "enable_tiling"):
        vae.enable_tiling()
        _cap_tile(vae)
    elif hasattr(vae, "disable_tiling"):
        vae.disable_tiling()
    return tiled and hasattr(vae, "enable_tiling")


def _cap_tile(vae: Any) -> None:
    """Keep the tile within the size the plan's peak assumed (AutoencoderKL tiles at
    its sample size, 1024 px for the served VAEs)."""
    sample = getattr(vae, "tile_sample_min_size", None)
    latent = getattr(vae, "tile_latent_min_size", None)
    if isinstance(sample, int) and isinstance(latent, int) and sample > VAE_TILE_PX:
        vae.tile_latent_min_size = max(1, latent * VAE_TILE_PX // sample)
        vae.tile_sample_min_size = VAE_TILE_PX
