"""The one preprocessing implementation: image bytes → the model's normalised input.

Preprocess (training data), batch inference and serving all call
:func:`decode_image`, so a model sees the same pixels in every stage. Two steps:

1. :func:`decode_rgb` never trusts the bytes: it reads the header first and
   checks the pixel count before any pixel is decoded (decompression bombs),
   applies the EXIF orientation, composites transparency onto white (rather
   than dropping the alpha channel, which turns transparent areas into
   whatever colour they happen to hold) and converts any mode (grayscale,
   palette, CMYK, 16-bit) to RGB. Every failure is a typed exception the
   caller records.
2. :func:`to_model_input` resizes and crops the PIL image — for
   ``resize_crop`` with torchvision's own functional transforms, as the
   ``transforms()`` of a torchvision weights entry does — then scales to
   [0, 1] and normalises.

For ``resize_crop`` specs the output equals ``weights.transforms()`` applied
to the same decoded RGB image within ``IMAGENET_MAX_ABS_DIFF`` (asserted by
tests/unit/test_preprocessing.py).

JPEG draft decoding (``ImageSpec.draft``, off unless asked for): a JPEG over
twice the size the spec needs is decoded at a reduced DCT scale (1/2, 1/4,
1/8), never below twice that size, and the antialiased resize does the rest.
It makes multi-megapixel photos cheaper to decode at the price of exact
equality with full decoding; ``bench/preprocessing.py`` measures both.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from rayline.specs import DEFAULT_MAX_PIXELS, RESIZE_CROP, ImageSpec

__all__ = ["DEFAULT_MAX_PIXELS", "ImageSpec", "decode_image", "decode_rgb", "to_model_input"]

# float32 rounding of the normalisation: torchvision divides by 255 then normalises in float32
# tensors, this module does the same arithmetic in numpy; measured differences are ~5e-7.
IMAGENET_MAX_ABS_DIFF = 1e-5
BACKGROUND = (255, 255, 255)


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


def decode_image(data: bytes | None, spec: ImageSpec) -> np.ndarray:
    """Bytes → normalised float32 array of shape (3, crop, crop).

    Raises an :class:`ImageDecodeError` subclass naming what was wrong.
    """
    return to_model_input(decode_rgb(data, spec), spec)


def decode_rgb(data: bytes | None, spec: ImageSpec) -> Image.Image:
    """Bytes → an upright RGB image (EXIF orientation applied, transparency on white)."""
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
                if spec.draft and img.format == "JPEG":
                    # draft picks the largest DCT reduction that keeps both sides >= the request
                    side = 2 * spec.needed_side
                    img.draft("RGB", (side, side))
                return _to_rgb(ImageOps.exif_transpose(img))
    except ImageDecodeError:
        raise
    except UnidentifiedImageError as exc:
        raise UnsupportedFormatError(f"not a recognised image format ({len(data)} bytes)") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(str(exc)) from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # truncated or corrupt data surfaces as OSError/SyntaxError inside PIL's plugins
        raise CorruptImageError(f"corrupt image data: {exc}") from exc


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "P":
        # palette transparency lives in img.info; RGBA carries it into the composite below
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "RGBa", "La", "PA"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode.startswith("I;16") or img.mode == "I":
        # 16-bit grayscale: scale to 8 bits rather than clip everything above 255 to white
        array = np.asarray(img, dtype=np.float32)
        peak = 65535.0 if img.mode.startswith("I;16") else max(float(array.max()), 1.0)
        img = Image.fromarray(np.clip(array * (255.0 / peak), 0, 255).astype(np.uint8))
    img.load()
    return img.convert("RGB")


def to_model_input(rgb: Image.Image, spec: ImageSpec) -> np.ndarray:
    """An RGB image → normalised float32 (3, crop, crop)."""
    resample = _PIL_RESAMPLE[spec.interpolation]
    if spec.mode == RESIZE_CROP:
        # torchvision's own functional transforms, as the weights entry's transforms() applies them
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as F

        assert spec.resize is not None  # the spec's validator guarantees it
        resized = F.resize(rgb, [spec.resize], interpolation=InterpolationMode(spec.interpolation), antialias=True)
        image = F.center_crop(resized, [spec.crop])
    else:
        # torchvision's F.resize of a PIL image to (crop, crop) is exactly this PIL call; calling PIL
        # directly spares the digits' Ray Data workers importing torch + torchvision (seconds each: bench/README.md)
        image = rgb.resize((spec.crop, spec.crop), resample)
    array = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    return np.ascontiguousarray(((array - mean) / std).transpose(2, 0, 1))


_PIL_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}
