"""The one preprocessing implementation: image bytes → the model's normalised input.

Preprocess, batch inference and serving all call :func:`decode_image`, so a model sees the same pixels in
every stage. :func:`decode_rgb` never trusts the bytes: it checks the pixel count from the header before
decoding (decompression bombs), applies the EXIF orientation, composites transparency onto white (dropping
alpha would show whatever colour transparent pixels hold) and converts any mode to RGB; every failure is a
typed :class:`ImageDecodeError`. :func:`to_model_input` resizes and crops (``resize_crop`` with
torchvision's own functional transforms, as a weights entry's ``transforms()`` does), scales and normalises.

With full decoding (``ImageSpec.draft`` false) a ``resize_crop`` spec's output equals ``weights.transforms()``
within ``IMAGENET_MAX_ABS_DIFF`` (tests/unit/test_preprocessing.py). By default a JPEG over twice the needed
size is decoded at a reduced DCT scale (never below twice that size), and the antialiased resize samples
the same geometry as the full decode: a 12 MP photo decodes several times faster, and the model input stays
within ``DRAFT_MAX_MEAN_ABS_DIFF`` of full decoding (``bench/preprocessing.py``; figures in bench/README.md).
``draft=False`` (``register-model --full-decode``) keeps equality with torchvision's transforms(). A
version's execution plan may instead decode right down to the needed side (:data:`Decode` "1x"), where the
model's answers on the night's photos say it may (execution.decoding).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from rayline.errors import (
    CorruptImageError,
    EmptyImageError,
    ImageDecodeError,
    ImageTooLargeError,
    UnsupportedFormatError,
)
from rayline.specs import DEFAULT_MAX_PIXELS, RESIZE_CROP, ImageSpec

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "Decode",
    "ImageSpec",
    "Reduced",
    "decode_image",
    "decode_rgb",
    "decode_rows",
    "to_model_input",
]

# float32 rounding of the normalisation: torchvision divides by 255 then normalises in float32
# tensors, this module does the same arithmetic in numpy; measured differences are ~5e-7.
IMAGENET_MAX_ABS_DIFF = 1e-5
# reduced-scale vs full decoding: the bound on one photo's mean |difference| of model input (normalised units,
# std ~0.226: 0.015 is under one grey level of 255); measured at most 0.009 over 360 photos, ~0.005 on camera
# photos, about what one more JPEG save at quality 90 changes (bench/README.md)
DRAFT_MAX_MEAN_ABS_DIFF = 0.015
BACKGROUND = (255, 255, 255)

# How a JPEG is decoded: in full, or at the largest DCT reduction keeping both sides at least twice ("2x") or
# once ("1x") the side the spec needs. A version's plan chooses it by the model's answers (execution.decoding);
# without a plan, a spec with ``draft`` decodes at 2x and one without in full.
Decode = Literal["full", "2x", "1x"]
DRAFT_FACTORS: dict[str, int] = {"2x": 2, "1x": 1}


class Reduced(NamedTuple):
    """Where a reduced-scale decode came from: the upright full size, and the box of the image that holds it."""

    full_size: tuple[int, int]
    box: tuple[float, float, float, float]


def decode_image(data: bytes | None, spec: ImageSpec, decode: Decode | None = None) -> np.ndarray:
    """Bytes → normalised float32 array of shape (3, crop, crop); an :class:`ImageDecodeError` names what is wrong.

    ``decode``: a plan's choice (:data:`Decode`); None, the spec's own (2x with ``draft``, else full).
    """
    rgb, reduced = _decode(data, spec, decode)
    return to_model_input(rgb, spec, reduced)


def default_decode(spec: ImageSpec) -> Decode:
    """What a spec decodes with when no plan chose: reduced to 2x with ``draft``, else in full."""
    return "2x" if spec.draft else "full"


def decode_rows(
    data: Sequence[bytes | None] | np.ndarray,
    fetch_errors: Sequence[tuple[str, str] | None],
    spec: ImageSpec,
    decode: Decode | None = None,
) -> dict[str, np.ndarray]:
    """Decode each row's image; a fetch error (type, message) or a bad image, whatever the decoder raised,
    becomes the row's error fields: one bad sample is one error row, never an exception."""
    n = len(data)
    images = np.zeros((n, 3, spec.size, spec.size), dtype=np.float32)
    stage: list[str | None] = [None] * n
    error_type: list[str | None] = [None] * n
    message: list[str | None] = [None] * n
    for i, (item, fetch_error) in enumerate(zip(data, fetch_errors, strict=True)):
        if fetch_error is not None:
            stage[i], (error_type[i], message[i]) = "fetch", fetch_error
            continue
        try:
            images[i] = decode_image(item, spec, decode)
        except Exception as exc:  # the decoder (PIL, its plugins) may raise anything on a bad image: one bad sample
            stage[i], error_type[i], message[i] = "decode", type(exc).__name__, str(exc)[:500]
    return {
        "image": images,
        "ok": np.array([t is None for t in error_type], dtype=bool),
        "stage": np.array(stage, dtype=object),
        "error_type": np.array(error_type, dtype=object),
        "error_message": np.array(message, dtype=object),
    }


def reducible(data: bytes | None, spec: ImageSpec) -> bool:
    """Whether a plan's decode can change this photo: a JPEG whose shorter side is at least twice the needed
    side (reduced at 1x, it decodes at half scale or less), read from the header alone."""
    if not data or not spec.draft:
        return False
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.format == "JPEG" and min(img.size) >= 2 * spec.needed_side
    except (OSError, SyntaxError, ValueError):  # not an image: its decode fails every way alike
        return False


def decode_rgb(data: bytes | None, spec: ImageSpec) -> Image.Image:
    """Bytes → an upright RGB image (EXIF orientation applied, transparency on white), maybe at a reduced scale."""
    return _decode(data, spec)[0]


def _decode(data: bytes | None, spec: ImageSpec, decode: Decode | None = None) -> tuple[Image.Image, Reduced | None]:
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
                factor = DRAFT_FACTORS.get(decode or default_decode(spec))
                reduced = _draft(img, spec, factor) if factor and img.format == "JPEG" else None
                return _to_rgb(ImageOps.exif_transpose(img)), reduced
    except ImageDecodeError:
        raise
    except UnidentifiedImageError as exc:
        raise UnsupportedFormatError(f"not a recognised image format ({len(data)} bytes)") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(str(exc)) from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # truncated or corrupt data surfaces as OSError/SyntaxError inside PIL's plugins
        raise CorruptImageError(f"corrupt image data: {exc}") from exc


def _draft(img: Image.Image, spec: ImageSpec, factor: int) -> Reduced | None:
    """Ask the JPEG decoder for the largest DCT reduction that keeps both sides >= ``factor`` × the needed side.

    2x stays within DRAFT_MAX_MEAN_ABS_DIFF of full decoding on camera photos; 1x is 1.2-1.4x faster again but
    2-3x further in pixels, so a plan takes it only where the model's answers agree (execution.decoding).
    """
    full_size = img.size
    side = factor * spec.needed_side
    drafted = img.draft("RGB", (side, side))
    if drafted is None or img.size == full_size:
        return None
    orientation = int(img.getexif().get(ExifTags.Base.Orientation, 1))
    move = _EXIF_MOVES.get(orientation)
    if move is None:
        return Reduced(full_size, drafted[1])
    # the box in the upright image exif_transpose makes: the overhang may end up on any side
    x0, y0, x1, y1 = drafted[1]
    (ax, ay), (bx, by) = move(x0, y0, *img.size), move(x1, y1, *img.size)
    upright = full_size[::-1] if orientation >= 5 else full_size
    return Reduced((upright[0], upright[1]), (min(ax, bx), min(ay, by), max(ax, bx), max(ay, by)))


# where exif_transpose's transposition for each EXIF orientation takes a point (x, y) of a width × height image
_EXIF_MOVES: dict[int, Callable[[float, float, int, int], tuple[float, float]]] = {
    2: lambda x, y, w, h: (w - x, y),  # FLIP_LEFT_RIGHT
    3: lambda x, y, w, h: (w - x, h - y),  # ROTATE_180
    4: lambda x, y, w, h: (x, h - y),  # FLIP_TOP_BOTTOM
    5: lambda x, y, w, h: (y, x),  # TRANSPOSE
    6: lambda x, y, w, h: (h - y, x),  # ROTATE_270
    7: lambda x, y, w, h: (h - y, w - x),  # TRANSVERSE
    8: lambda x, y, w, h: (y, w - x),  # ROTATE_90
}


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


def to_model_input(rgb: Image.Image, spec: ImageSpec, reduced: Reduced | None = None) -> np.ndarray:
    """An RGB image → normalised float32 (3, crop, crop); ``reduced``: it was decoded at a reduced scale."""
    resample = _PIL_RESAMPLE[spec.interpolation]
    if spec.mode == RESIZE_CROP:
        # torchvision's own functional transforms, as the weights entry's transforms() applies them
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as F

        assert spec.resize is not None  # the spec's validator guarantees it
        if reduced is None:
            resized = F.resize(rgb, [spec.resize], interpolation=InterpolationMode(spec.interpolation), antialias=True)
        else:
            # F.resize's PIL call, sized from the full image: the reduced one's rounded sides can make the
            # resized image a pixel longer and shift the centre crop by up to a pixel
            resized = rgb.resize(_resized_size(reduced.full_size, spec.resize), resample, box=reduced.box)
        image = F.center_crop(resized, [spec.crop])
    else:
        # torchvision's F.resize of a PIL image to (crop, crop) is exactly this PIL call; calling PIL
        # directly spares the digits' Ray Data workers importing torch + torchvision (seconds each: bench/README.md)
        image = rgb.resize((spec.crop, spec.crop), resample, box=reduced.box if reduced else None)
    array = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    return np.ascontiguousarray(((array - mean) / std).transpose(2, 0, 1))


def _resized_size(size: tuple[int, int], shorter: int) -> tuple[int, int]:
    """The (width, height) torchvision's ``F.resize(img, [shorter])`` gives an image of ``size``."""
    width, height = size
    if width <= height:
        return shorter, int(shorter * height / width)
    return int(shorter * width / height), shorter


_PIL_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}
