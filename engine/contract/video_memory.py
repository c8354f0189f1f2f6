"""What a video checkpoint holds at its peak, per clip: the figures its plan sizes from.

A clip's headroom is not an image's: its denoiser sees every latent frame's
tokens at once, and its VAE decodes the whole clip in overlapping spatial
tiles whose outputs (every frame of every tile) stay live until they are
blended into the clip. :mod:`engine.policy.activations` turns these figures
into GB for a request's frames x size; ``bench/video_memory.py --derive``
measures them at a checkpoint's real widths under fake tensors and checks
the estimate against the counted bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VideoMemory:
    """A video checkpoint's measured memory figures (elements; the dtype is the plan's)."""

    #: Elements one denoiser forward holds live per latent token at its peak (one block
    #: at a time in inference: the residual stream, one block's attention and FFN).
    denoiser_per_token: float
    #: Elements one tile's decoder holds at its peak (its convolutions over one latent
    #: frame chunk, the causal cache), beside the tile outputs already decoded.
    decode_tile_elements: float
    #: The side of one VAE tile in output pixels (diffusers' ``tile_sample_min_*``).
    tile_px: int = 256
    #: One tile every this many output pixels (``tile_sample_stride_*``): overlapping
    #: tiles decode more pixels than the clip has.
    tile_stride_px: int = 192
    #: Whole-clip copies the decode's assembly holds at its end beside the tile outputs
    #: (the blended rows, their concatenation, the unpatchified and clamped clip).
    clip_copies: int = 3

    def __post_init__(self) -> None:
        if self.denoiser_per_token < 0 or self.decode_tile_elements < 0:
            raise ValueError("VideoMemory figures are element counts and cannot be negative")
        if not 0 < self.tile_stride_px <= self.tile_px:
            raise ValueError("VideoMemory.tile_stride_px must be positive and at most tile_px")
        if self.clip_copies < 1:
            raise ValueError("VideoMemory.clip_copies must be at least 1")
