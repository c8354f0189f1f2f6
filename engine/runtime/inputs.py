"""Images into a generate: read, fitted to the model's sides, cast for its VAE.

An input image (img2img, inpaint, edit, a ControlNet map) is fitted *within*
the requested box (``width`` x ``height``; the image's own size when none is
asked) keeping its aspect ratio, then both sides are rounded down to the
family's ``side_multiple`` (VAE stride x patch), so the denoiser never sees a
side it cannot take and the output is exactly the size the input was fitted
to. A fit that leaves a side under one multiple, or an input over the side
limit with no box, is refused naming the control to change. The image
becomes a ``(1, 3, H, W)`` tensor in ``[0, 1]`` in the VAE's dtype (the
pipeline's processor normalises it), so an fp16 / bf16 VAE never meets a
float32 input; a mask stays a one-channel PIL image (the pipeline's mask
processor binarises it) at the same size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from engine.preflight.images import InvalidImage, decode_image

#: What a request may carry as an image: a path, encoded bytes, or a PIL image.
ImageLike = str | Path | bytes | Image.Image

#: Longest side an input image is taken at without a requested box.
MAX_INPUT_SIDE = 4096


@dataclass(frozen=True)
class FittedInputs:
    """The inputs of one generate, fitted to one size."""

    width: int
    height: int
    #: ``(1, 3, H, W)`` in [0, 1] (4 channels for a model that reads alpha), the VAE's dtype;
    #: None for text-to-image.
    image: torch.Tensor | None = None
    #: One-channel mask, white where the image is redrawn.
    mask: Image.Image | None = None
    #: The fitted input as RGB (RGBA for a model that reads alpha), kept to paste the unmasked
    #: pixels back.
    original: Image.Image | None = None
    #: ``image`` is a ControlNet's control map, not an image to redraw.
    control: bool = False
    #: A multi-image edit's further input images (RGB, or RGBA as above) at their own size: the pipeline sizes
    #: its references itself (to about a megapixel), so fitting them to the output box first
    #: would only lose detail, or leave a side under what its processor takes.
    references: tuple[Image.Image, ...] = ()


def read_image(value: ImageLike, field: str) -> Image.Image:
    """``value`` decoded, after its header showed it within the size caps (:mod:`engine.preflight.images`)."""
    return value if isinstance(value, Image.Image) else decode_image(value, field)


def read_mask(value: ImageLike) -> Image.Image:
    """A mask as one channel, white where the image is redrawn.

    A mask that uses transparency marks the area to redraw by it, as
    OpenAI's image edits define (fully transparent = redraw); any other mask
    is read as grey levels (white = redraw)."""
    mask = read_image(value, "mask_image")
    if "A" in mask.getbands():
        alpha = mask.getchannel("A")
        if alpha.getextrema()[0] < 255:
            return alpha.point(lambda level: 255 if level == 0 else 0)
    return mask.convert("L")


def fitted_size(size: tuple[int, int], box: tuple[int | None, int | None], multiple: int, field: str) -> tuple[int, int]:
    """(width, height) of ``size`` fitted within ``box`` at ``multiple``.

    With both sides of the box given, the image is scaled (up or down) to the
    largest size with its aspect ratio inside the box; with one side given,
    to that side; with none, it keeps its size (refused over
    :data:`MAX_INPUT_SIDE`). Sides are then rounded down to ``multiple``.
    """
    width, height = size
    box_w, box_h = box
    if box_w and box_h:
        scale = min(box_w / width, box_h / height)
    elif box_w:
        scale = box_w / width
    elif box_h:
        scale = box_h / height
    else:
        if max(width, height) > MAX_INPUT_SIDE:
            raise InvalidImage(
                f"{field} is {width}x{height}, over the {MAX_INPUT_SIDE}-pixel side limit; "
                "set width and height to fit it into a smaller box"
            )
        scale = 1.0
    fit_w = int(width * scale + 1e-6) // multiple * multiple
    fit_h = int(height * scale + 1e-6) // multiple * multiple
    if fit_w < multiple or fit_h < multiple:
        raise InvalidImage(
            f"{field} ({width}x{height}) fitted within {box_w or '-'}x{box_h or '-'} leaves a side under "
            f"{multiple} pixels, the model's multiple; raise width / height or give a less elongated image"
        )
    return fit_w, fit_h


def fit_inputs(
    image: ImageLike | Sequence[ImageLike] | None,
    mask: ImageLike | None,
    *,
    width: int | None,
    height: int | None,
    multiple: int,
    dtype: torch.dtype,
    alpha: bool = False,
) -> FittedInputs:
    """The request's image (and mask) fitted to one size; see the module doc. ``alpha``: the
    model reads RGBA (its table's ``Rendering.alpha``), so the images keep their alpha (an
    image without one is opaque); otherwise the alpha is dropped."""
    mode = "RGBA" if alpha else "RGB"
    if image is None:
        if mask is not None:
            raise InvalidImage("mask_image was given without image; inpainting needs both")
        return FittedInputs(width=width or 0, height=height or 0)
    if isinstance(image, (list, tuple)):  # a multi-image edit: the first leads, the rest ride along
        if mask is not None:
            raise InvalidImage("mask_image takes one image; give one image to inpaint")
        first = fit_inputs(image[0], None, width=width, height=height, multiple=multiple, dtype=dtype, alpha=alpha)
        references = [read_image(value, f"image[{index}]").convert(mode) for index, value in enumerate(image[1:], 1)]
        return dataclasses.replace(first, references=tuple(references))
    picture = read_image(image, "image").convert(mode)
    fit_w, fit_h = fitted_size(picture.size, (width, height), multiple, "image")
    picture = _resized(picture, fit_w, fit_h)
    pixels = torch.from_numpy(np.asarray(picture, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
    fitted_mask = None
    if mask is not None:
        fitted_mask = _resized(read_mask(mask), fit_w, fit_h)
    return FittedInputs(fit_w, fit_h, pixels.to(dtype), fitted_mask, picture)


def vae_dtype(pipe: Any) -> torch.dtype:
    """The dtype the pipeline's VAE holds its weights in (float32 without one)."""
    vae = getattr(pipe, "vae", None)
    return getattr(vae, "dtype", torch.float32) if vae is not None else torch.float32


def paste_unmasked(result: Image.Image, original: Image.Image, mask: Image.Image) -> Image.Image:
    """``result`` with the pixels the mask keeps (black) taken from ``original``.

    A VAE round trip is lossy (a tiny random one entirely, a real one
    slightly), so the pipeline's output drifts outside the mask; pasting the
    input back, as inpainting front ends do, keeps those pixels exactly.
    """
    keep = Image.eval(mask, lambda v: 255 if v < 128 else 0)
    composed = result.convert(original.mode).copy()
    composed.paste(original, (0, 0), keep)
    return composed


def _resized(image: Image.Image, width: int, height: int) -> Image.Image:
    if image.size == (width, height):
        return image
    return image.resize((width, height), Image.Resampling.LANCZOS)


def canny_map(image: Image.Image, low: int = 100, high: int = 200) -> Image.Image:
    """A Canny-style edge map (white edges on black, RGB) for an edge ControlNet.

    OpenCV is not a dependency, so this is the Sobel half of Canny: gradient
    magnitude of the grey image (0-255 scale, as ``cv2.Canny`` thresholds it),
    strong edges above ``high`` kept, weak ones above ``low`` kept where they
    touch a strong one (one pass of hysteresis), no non-maximum thinning.
    """
    grey = np.asarray(image.convert("L"), dtype=np.float32)
    padded = np.pad(grey, 1, mode="edge")
    gx = (padded[:-2, 2:] + 2 * padded[1:-1, 2:] + padded[2:, 2:]) - (padded[:-2, :-2] + 2 * padded[1:-1, :-2] + padded[2:, :-2])
    gy = (padded[2:, :-2] + 2 * padded[2:, 1:-1] + padded[2:, 2:]) - (padded[:-2, :-2] + 2 * padded[:-2, 1:-1] + padded[:-2, 2:])
    magnitude = np.hypot(gx, gy) / 4.0  # Sobel's 4x gain back to intensity steps
    strong = magnitude >= high
    near = np.pad(strong, 1)
    touching = near[:-2, :-2] | near[:-2, 1:-1] | near[:-2, 2:] | near[1:-1, :-2] | near[1:-1, 2:] | near[2:, :-2] | near[2:, 1:-1] | near[2:, 2:]
    edges = strong | ((magnitude >= low) & touching)
    return Image.fromarray(np.where(edges, 255, 0).astype(np.uint8)).convert("RGB")
