"""Image decoding and normalisation shared by preprocess, inference and serve.

Decoding is per sample and never trusts the bytes: the header is read first
and the pixel count checked before any pixel is decoded (decompression
bombs), and every failure is a typed exception the caller records.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, Field

DEFAULT_MAX_PIXELS = 40_000_000


class ImageDecodeError(ValueError):
    """The bytes are not a decodable image."""


class EmptyImageError(ImageDecodeError):
    """Zero bytes where an image was expected."""


class UnsupportedFormatError(ImageDecodeError):
    """The bytes are not in any image format PIL recognises."""


class CorruptImageError(ImageDecodeError):
    """A recognised format whose data is truncated or damaged."""


class ImageTooLargeError(ImageDecodeError):
    """The image declares more pixels than the configured limit."""


class ImageSpec(BaseModel):
    """How raw images become model input; the same spec must serve training and inference."""

    size: int = Field(32, ge=4, le=1024)
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1)


def decode_image(data: bytes | None, spec: ImageSpec) -> np.ndarray:
    """Bytes → normalised float32 array of shape (3, size, size).

    Raises an :class:`ImageDecodeError` subclass naming what was wrong.
    """
    if not data:
        raise EmptyImageError("object is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # PIL warns (rather than raises) between 1x and 2x its own limit
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
                if width * height > spec.max_pixels:
                    raise ImageTooLargeError(
                        f"image is {width}x{height} = {width * height} pixels, limit is {spec.max_pixels}"
                    )
                img.draft("RGB", (spec.size, spec.size))  # JPEG: decode at reduced scale
                rgb = img.convert("RGB").resize((spec.size, spec.size), Image.Resampling.BILINEAR)
    except ImageDecodeError:
        raise
    except UnidentifiedImageError as exc:
        raise UnsupportedFormatError(f"not a recognised image format ({len(data)} bytes)") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(str(exc)) from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # truncated or corrupt data surfaces as OSError/SyntaxError inside PIL's plugins
        raise CorruptImageError(f"corrupt image data: {exc}") from exc
    array = np.asarray(rgb, dtype=np.float32) / 255.0
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    return np.ascontiguousarray(((array - mean) / std).transpose(2, 0, 1))
