"""Activation guard and VAE tiling: memory that grows with resolution x batch. Pure.

The memory plan's overhead was a fixed 2 GiB at any size; a 2048 px image
holds four times the activations of a 1024 px one. The guard reads the
same measured per-token figures the training memory estimate uses
(:class:`engine.contract.types.ActivationFigures`): what one repeated block saves
for backward per token bounds what it holds live at once in a forward, and
inference holds one block's activations at a time, plus what lies outside
the blocks. The VAE decoder's peak is the family's ``vae_decode_per_pixel``
figure per output pixel; tiled, it is one tile's.

So the overhead a plan reserves is ``max(floor, context + max(denoiser
activations, VAE decode))`` for the request's resolution and batch, and a
plan names the image size above which the VAE decodes in tiles: the
largest one whose untiled decode fits the headroom the weights leave.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.hardware.profile import GIB_IN_GB
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.choices import VAE_TILING_REQUESTS
from engine.contract.types import Checkpoint, FamilySpec, LatentGeometry, VideoMemory

#: Resolution assumed when a load names none: the served families' native size.
DEFAULT_SIDE_PX = 1024
#: CUDA context, allocator and cuBLAS workspaces beside the activations.
CONTEXT_GB = 1 * GIB_IN_GB
#: The side of one VAE tile: the session caps the VAE's tile at this size when
#: it engages tiling, so this bounds a tiled decode's peak.
VAE_TILE_PX = 512


@dataclass(frozen=True)
class ImageShape:
    """What one generate call renders: the size and how many images at once."""

    width: int = DEFAULT_SIDE_PX
    height: int = DEFAULT_SIDE_PX
    batch: int = 1
    #: Frames of a clip (1: an image).
    frames: int = 1

    @property
    def pixels(self) -> int:
        return self.width * self.height

    def image_tokens(self, geometry: LatentGeometry) -> int:
        """Tokens one image of this size is to a denoiser of ``geometry`` (a partial one counts)."""
        side = geometry.token_pixels
        return math.ceil(self.width / side) * math.ceil(self.height / side)


def denoiser_activation_gb(family: FamilySpec, shape: ImageShape, dtype_bytes: float) -> float:
    """GB one denoiser forward holds live at its peak; 0 where the family has no figures."""
    figures = family.training.memory.activations if family.training.memory else None
    if figures is None:
        return 0.0
    per_image = figures.block_per_image_token + figures.outside_per_image_token
    per_text = figures.block_per_text_token + figures.outside_per_text_token
    elements = per_image * shape.image_tokens(family.rendering.geometry) + per_text * figures.text_tokens
    return elements * shape.batch * dtype_bytes / 1e9


def vae_decode_gb(family: FamilySpec, pixels: int, dtype_bytes: float) -> float:
    """GB the VAE decoder holds at its peak decoding ``pixels`` output pixels at once."""
    return family.rendering.vae_decode_per_pixel * pixels * dtype_bytes / 1e9


def guarded_overhead_gb(
    family: FamilySpec, shape: ImageShape, dtype_bytes: float, floor_gb: float,
    checkpoint: Checkpoint | None = None,
) -> tuple[float, str]:
    """The plan's overhead for ``shape``, and how it was sized.

    The VAE term assumes a tiled decode when the untiled one would be the
    larger peak (the tiling control then engages), sliced over the batch.
    """
    if family.rendering.output == "frames":
        return video_overhead_gb(family, checkpoint, shape, dtype_bytes, floor_gb)
    activations = denoiser_activation_gb(family, shape, dtype_bytes)
    tile = vae_decode_gb(family, min(shape.pixels, VAE_TILE_PX**2), dtype_bytes)
    guard = CONTEXT_GB + max(activations, tile)
    how = (
        f"{shape.width}x{shape.height} x{shape.batch}: denoiser activations {activations:.1f} GB, "
        f"VAE decode {tile:.1f} GB, context {CONTEXT_GB:.1f} GB"
    )
    if guard <= floor_gb:
        return floor_gb, f"{how}: within the {floor_gb:.1f} GB floor"
    return guard, how


#: A clip's headroom where its table has no :class:`VideoMemory` figures (the earlier system's
#: rule): 4 GiB plus three fp32 RGB copies of every frame, and never under 3 GiB.
VIDEO_BASE_GB, VIDEO_FLOOR_GB, VIDEO_COPIES = 4 * GIB_IN_GB, 3 * GIB_IN_GB, 3
#: Channels of a decoded frame.
RGB = 3


def video_overhead_gb(
    family: FamilySpec, checkpoint: Checkpoint | None, shape: ImageShape, dtype_bytes: float, floor_gb: float
) -> tuple[float, str]:
    """A clip's overhead: the larger of one denoiser forward over every latent frame's tokens
    and the tiled decode (every tile's frames live, then the assembled clip), plus the context.

    Sized from the checkpoint's :class:`VideoMemory` figures; without them, the generic rule.
    """
    video = family.video_of(checkpoint)
    memory = video.memory if video else None
    if video is None or memory is None:
        frames_gb = VIDEO_COPIES * shape.frames * shape.pixels * RGB * 4 * shape.batch / 1e9
        guard = max(VIDEO_FLOOR_GB, VIDEO_BASE_GB + frames_gb, floor_gb)
        return guard, (f"{shape.frames} frames of {shape.width}x{shape.height}: {VIDEO_BASE_GB:.1f} GB + "
                       f"{VIDEO_COPIES} fp32 copies of the clip ({frames_gb:.1f} GB)")
    geometry = family.geometry_of(checkpoint)
    side = geometry.token_pixels
    tokens = video.latent_frames(shape.frames) * math.ceil(shape.width / side) * math.ceil(shape.height / side)
    denoiser = memory.denoiser_per_token * tokens * dtype_bytes * shape.batch / 1e9
    vae_bytes = 4 if family.precision.keeps_fp32("vae") else dtype_bytes
    tiles = (tiled_px(shape.width, geometry.spatial_compression, memory)
             * tiled_px(shape.height, geometry.spatial_compression, memory) * shape.frames * RGB)
    clip = shape.pixels * shape.frames * RGB
    decode = (tiles + max(memory.decode_tile_elements, memory.clip_copies * clip)) * vae_bytes * shape.batch / 1e9
    guard = CONTEXT_GB + max(denoiser, decode)
    how = (f"{shape.frames} frames of {shape.width}x{shape.height} x{shape.batch}: denoiser {denoiser:.1f} GB "
           f"({tokens} tokens), tiled VAE decode {decode:.1f} GB, context {CONTEXT_GB:.1f} GB")
    if guard <= floor_gb:
        return floor_gb, f"{how}: within the {floor_gb:.1f} GB floor"
    return guard, how


def tiled_px(pixels: int, compression: int, memory: VideoMemory) -> int:
    """Output pixels the overlapping tiles decode along a side of ``pixels`` (each tile is
    ``tile_px`` wide, cut at the edge, one every ``tile_stride_px``)."""
    latent = pixels // compression
    tile, stride = max(1, memory.tile_px // compression), max(1, memory.tile_stride_px // compression)
    return sum(min(tile, latent - start) for start in range(0, latent, stride)) * compression


def resolve_vae_tiling(
    family: FamilySpec, headroom_gb: float, dtype_bytes: float, requested: str = "auto"
) -> Resolved[int | None]:
    """The image side (px, of the equivalent square) above which the VAE decodes in
    tiles: 0 always, None never. ``headroom_gb``: what the plan leaves beside its
    weights and context at the decode."""
    if requested not in VAE_TILING_REQUESTS:
        raise ValueError(f"vae_tiling {requested!r} is not one of {', '.join(VAE_TILING_REQUESTS)}")
    if requested == "on":
        return explicit(0, "every decode is tiled, as asked")
    if requested == "off":
        return explicit(None, "never tiled, as asked: a large image may run out of memory at the decode")
    if family.rendering.output == "frames":
        return auto(0, "a video always decodes in tiles: the whole clip's frames would be live at once")
    per_pixel_gb = family.rendering.vae_decode_per_pixel * dtype_bytes / 1e9
    if per_pixel_gb <= 0:
        return auto(None, f"{family.label}'s table has no VAE decode figure; the decode is not tiled")
    token = family.rendering.geometry.token_pixels
    side = int(math.sqrt(max(0.0, headroom_gb) / per_pixel_gb)) // token * token
    return auto(
        side,
        f"an untiled decode above {side}x{side} px ({family.rendering.vae_decode_per_pixel:g} elements per pixel) "
        f"would not fit the {headroom_gb:.1f} GB the weights leave: larger images decode in tiles",
    )


def resolve_vae_slicing(family: FamilySpec) -> Resolved[bool]:
    """Decode a batch one image at a time (the peak is one image's; no measurable cost)."""
    if family.rendering.vae_decode_per_pixel <= 0:
        return auto(False, f"{family.label}'s table has no VAE decode figure")
    return auto(True, "a batch decodes one image at a time: the decode peak is one image's")
