"""Input images sized from their headers before a pixel is decoded.

A PNG of a few hundred KB can declare 12000x12000 pixels and cost gigabytes
once decoded, so every image a request brings (an img2img or edit input, a
mask, a ControlNet map; a path or an upload) is opened lazily first: Pillow
reads the header and says the size, and a file over the byte cap or an image
over the pixel cap is refused (``invalid_image``, naming the field) before
it is decoded. Pillow's own refusals (not an image, a truncated header, its
decompression-bomb error) become the same code. Torch-free, so the server
checks before a job is queued and the CLI before anything is loaded.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from engine.errors import EngineError

#: The most pixels an input image may have: 8192x8192, twice the longest side a request
#: takes without a box (:data:`engine.runtime.inputs.MAX_INPUT_SIDE`) in each direction.
#: Decoded as RGBA that is 256 MB; a 12000x12000 bomb is over it.
MAX_INPUT_PIXELS = 8192 * 8192
#: The most bytes of an input image file (a 50-megapixel PNG is well under it).
MAX_INPUT_BYTES = 256 * 1024 * 1024


class InvalidImage(EngineError):
    """An input image that cannot be read, is too large, or cannot be fitted; the message names the field."""

    code = "invalid_image"


def image_size(
    value: str | Path | bytes, field: str, *, max_pixels: int = MAX_INPUT_PIXELS, max_bytes: int = MAX_INPUT_BYTES
) -> tuple[int, int]:
    """(width, height) as ``value``'s header declares them, within the caps; nothing decoded.

    :raises InvalidImage: naming ``field``: no such file, too many bytes or pixels, or not an image.
    """
    image = _opened(value, field, max_pixels, max_bytes)
    image.close()
    return image.size


def named_images(value: Any, field: str) -> list[tuple[str, Any]]:
    """Each image of a request field with the name a refusal gives it: ``field`` alone, or
    ``field[i]`` for each of a multi-image edit's list."""
    if isinstance(value, (list, tuple)):
        return [(f"{field}[{index}]", each) for index, each in enumerate(value)]
    return [] if value is None else [(field, value)]


def decode_image(value: str | Path | bytes, field: str) -> Image.Image:
    """``value`` decoded whole (a truncated file fails here, not mid-generate), once its
    header showed it within the caps: one open for both."""
    image = _opened(value, field, MAX_INPUT_PIXELS, MAX_INPUT_BYTES)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # sized by _opened
            image.load()
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        image.close()
        raise InvalidImage(f"{field}: {_what(value)} is not a readable image ({exc}); give a PNG, JPEG or WebP") from None
    return image


def _what(value: str | Path | bytes) -> str:
    return "the uploaded bytes" if isinstance(value, bytes) else str(value)


def _opened(value: str | Path | bytes, field: str, max_pixels: int, max_bytes: int) -> Image.Image:
    """``value`` opened lazily (Pillow has read the header only) and within the caps."""
    try:
        size = len(value) if isinstance(value, bytes) else Path(value).stat().st_size
    except FileNotFoundError:
        raise InvalidImage(f"{field}: no file at {value}; give the path of an image file") from None
    except OSError as exc:
        raise InvalidImage(f"{field}: {_what(value)} cannot be read ({exc.strerror or exc})") from None
    if size > max_bytes:
        raise InvalidImage(f"{field}: {_what(value)} is {size:,} bytes, over the {max_bytes:,}-byte limit for an input image")
    if size == 0:
        raise InvalidImage(f"{field}: {_what(value)} is empty (0 bytes); give a PNG, JPEG or WebP")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the cap below decides
            image = Image.open(io.BytesIO(value) if isinstance(value, bytes) else Path(value))
            frames = getattr(image, "n_frames", 1)
    except Image.DecompressionBombError as exc:
        raise InvalidImage(f"{field}: {_what(value)} is a decompression bomb ({exc}); give an image of at most "
                           f"{max_pixels:,} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidImage(f"{field}: {_what(value)} is not a readable image ({exc}); give a PNG, JPEG or WebP") from None
    width, height = image.size
    if width * height * max(1, frames) > max_pixels:
        image.close()
        many = f" x {frames} frames" if frames > 1 else ""
        raise InvalidImage(
            f"{field}: {_what(value)} declares {width}x{height}{many} pixels, over the {max_pixels:,}-pixel limit "
            "for an input image; downscale it first"
        )
    return image
