"""Sample data: scikit-learn's real handwritten digits and photos made from its two real JPEGs.

``raw/<label>/digit-<id>.png`` for the 1,797 digits, optional broken objects of several kinds (to exercise per-sample
error capture) and optional synthetic images (for scale). ``--photos N`` writes a day of photos instead: random crops,
scales, flips, JPEG qualities, grayscale and EXIF-rotated variants of scikit-learn's two real photos
(``<photo>/photo-<id>.jpg``, the source photo as the label), some over 2 megapixels. Deterministic for a given seed, and
idempotent: objects already present with the same size are not rewritten, so their etags (and the ingest content hash)
stay put. :func:`camera_photo` makes the 1–12 MP JPEGs a camera writes, for the benches and tests that measure what
decoding them costs.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from rayline import storage
from rayline.errors import ConfigError
from rayline.extras import install_hint

CORRUPT_KINDS = ("zero-bytes", "truncated-png", "text-as-png", "binary-as-png")
PHOTO_CORRUPT_KINDS = ("zero-bytes", "truncated-jpeg", "text-as-jpeg")
PHOTO_LABELS = ("china", "flower")  # scikit-learn's sample photos, in load_sample_images() order
EXIF_ORIENTATION = 0x0112
_ROTATED_90 = 6  # EXIF: the stored pixels must be rotated 90° clockwise to be upright
# the error type preprocess must record for each kind of broken object
EXPECTED_ERROR_TYPE = {
    "zero-bytes": "EmptyImageError",
    "truncated-jpeg": "CorruptImageError",
    "text-as-jpeg": "UnsupportedFormatError",
    "truncated-png": "CorruptImageError",
    "text-as-png": "UnsupportedFormatError",
    "binary-as-png": "UnsupportedFormatError",
}


@dataclass
class SeedResult:
    uri: str
    digits: int = 0
    corrupt: dict[str, str] = field(default_factory=dict)  # key -> kind
    synthetic: int = 0
    photos: int = 0
    written: int = 0
    skipped: int = 0

    @property
    def total(self) -> int:
        return self.digits + len(self.corrupt) + self.synthetic + self.photos


def png_bytes(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def digit_objects(size: int) -> Iterator[tuple[str, bytes]]:
    """The scikit-learn digits, upscaled to ``size`` and stored as RGB PNGs."""
    digits = _sklearn_dataset("load_digits")()
    for index, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        gray = Image.fromarray((image * (255.0 / 16.0)).astype(np.uint8))
        rgb = gray.resize((size, size), Image.Resampling.BILINEAR).convert("RGB")
        yield f"{int(label)}/digit-{index:05d}.png", png_bytes(np.asarray(rgb))


def corrupt_objects(count: int, size: int, rng: np.random.Generator) -> Iterator[tuple[str, bytes, str]]:
    """Broken objects of every kind in turn, under digit labels so they look real."""
    sample = png_bytes(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    for index in range(count):
        kind = CORRUPT_KINDS[index % len(CORRUPT_KINDS)]
        payload = {
            "zero-bytes": b"",
            "truncated-png": sample[: len(sample) // 2],
            "text-as-png": b"this is a text file that merely ends in .png\n" * 4,
            "binary-as-png": rng.integers(0, 256, 2048, dtype=np.uint8).tobytes(),
        }[kind]
        yield f"{index % 10}/corrupt-{kind}-{index:04d}.png", payload, kind


def synthetic_objects(count: int, size: int, rng: np.random.Generator) -> Iterator[tuple[str, bytes]]:
    """Coloured shapes on noise: cheap, varied, clearly unlike the digits."""
    for index in range(count):
        label = index % 10
        background = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
        img = Image.fromarray(background)
        draw = ImageDraw.Draw(img)
        colour = tuple(int(c) for c in rng.integers(120, 256, 3))
        box = sorted(rng.integers(0, size, 2).tolist())
        draw.ellipse((box[0], box[0], max(box[1], box[0] + 2), max(box[1], box[0] + 2)), fill=colour)
        draw.text((size // 3, size // 4), str(label), fill=(255, 255, 255))
        yield f"{label}/synthetic-{index:07d}.png", png_bytes(np.asarray(img))


def jpeg_bytes(img: Image.Image, quality: int = 90, exif: Image.Exif | None = None) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="JPEG", quality=quality, **({"exif": exif.tobytes()} if exif is not None else {}))
    return buffer.getvalue()


def source_photos() -> list[Image.Image]:
    """scikit-learn's two real 640×427 photos (china, flower) as RGB images."""
    return [Image.fromarray(photo) for photo in _sklearn_dataset("load_sample_images")().images]


def photo_variant(photo: Image.Image, rng: np.random.Generator, large: bool = False) -> tuple[bytes, str]:
    """One random view of ``photo`` as JPEG bytes, and what kind of view it is.

    A random crop of 30–100 % of each side, scaled to 0.25–1.5× (``large``: to over 2 megapixels), maybe mirrored, at
    JPEG quality 50–95; every seventh is grayscale and every fifth is stored rotated with an EXIF orientation tag that
    turns it upright again.
    """
    width, height = photo.size
    crop_w, crop_h = (max(16, int(side * rng.uniform(0.3, 1.0))) for side in (width, height))
    left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
    view = photo.crop((left, top, left + crop_w, top + crop_h))
    scale = float(np.sqrt(rng.uniform(2.1e6, 4.0e6) / (crop_w * crop_h))) if large else rng.uniform(0.25, 1.5)
    view = view.resize((max(8, int(crop_w * scale)), max(8, int(crop_h * scale))), Image.Resampling.BICUBIC)
    kind = "large" if large else "photo"
    if rng.random() < 0.5:
        view = view.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if rng.random() < 1 / 7:
        view, kind = view.convert("L"), f"{kind}-gray"
    exif = None
    if rng.random() < 1 / 5:
        # store it turned 90° anticlockwise and tag it: a reader that honours EXIF sees it upright
        view, exif, kind = view.transpose(Image.Transpose.ROTATE_90), Image.Exif(), f"{kind}-exif"
        exif[EXIF_ORIENTATION] = _ROTATED_90
    return jpeg_bytes(view, quality=int(rng.integers(50, 96)), exif=exif), kind


def photo_objects(count: int, rng: np.random.Generator, large_share: float = 0.1) -> Iterator[tuple[str, bytes]]:
    """``count`` views of the two real photos under ``<photo>/photo-<id>.jpg`` (the photo is the label)."""
    photos = source_photos()
    for index in range(count):
        which = index % len(photos)
        data, _ = photo_variant(photos[which], rng, large=rng.random() < large_share)
        yield f"{PHOTO_LABELS[which]}/photo-{index:06d}.jpg", data


CAMERA_MEGAPIXELS = (1, 3, 12)


def camera_size(megapixels: float) -> tuple[int, int]:
    """Width × height of a 4:3 photo of about ``megapixels``, in whole 16-pixel blocks (1 MP: 1152×864)."""
    width = 16 * max(1, round(math.sqrt(megapixels * 1e6 * 4 / 3) / 16))
    return width, width * 3 // 4


@functools.cache
def _cached_sources() -> tuple[Image.Image, ...]:
    return tuple(source_photos())


def camera_photo(megapixels: float, rng: np.random.Generator, photo: Image.Image | None = None) -> bytes:
    """A JPEG the size a camera writes: a 4:3 crop of one real photo upscaled to ``megapixels``, grain added.

    Upscaling alone gives a smooth image that compresses to a third of a camera's file and decodes faster than one;
    luminance grain at two scales (a few pixels wide, like foliage or fabric, and per pixel, like sensor noise) plus
    faint colour noise bring a 12 MP photo at quality 85–95 to a camera's 3–5 MB. ``photo``: one of scikit-learn's two
    when not given.
    """
    source = photo if photo is not None else _cached_sources()[int(rng.integers(len(PHOTO_LABELS)))]
    width, height = camera_size(megapixels)
    src_w, src_h = source.size
    crop_h = int(min(src_h, src_w * 3 / 4) * rng.uniform(0.4, 1.0))
    crop_w = crop_h * 4 // 3
    left, top = int(rng.integers(0, src_w - crop_w + 1)), int(rng.integers(0, src_h - crop_h + 1))
    view = source.convert("RGB").crop((left, top, left + crop_w, top + crop_h))
    pixels = np.asarray(view.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    coarse = Image.fromarray(rng.integers(116, 141, (max(1, height // 3), max(1, width // 3)), dtype=np.uint8))
    grain = np.asarray(coarse.resize((width, height), Image.Resampling.BILINEAR), dtype=np.int16) - 128
    grain += rng.integers(-7, 8, (height, width), dtype=np.int8)
    pixels += grain[..., None]
    pixels += rng.integers(-2, 3, (height, width, 3), dtype=np.int8)
    rgb = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return jpeg_bytes(rgb, quality=int(rng.integers(85, 96)))


def camera_photos(
    count: int, rng: np.random.Generator, megapixels: Sequence[float] = CAMERA_MEGAPIXELS
) -> Iterator[tuple[str, bytes]]:
    """``count`` camera-sized photos, the sizes in ``megapixels`` in turn: ``<photo>/camera-<mp>mp-<id>.jpg``."""
    photos = _cached_sources()
    for index in range(count):
        which, size = index % len(photos), megapixels[index % len(megapixels)]
        yield f"{PHOTO_LABELS[which]}/camera-{size:g}mp-{index:06d}.jpg", camera_photo(size, rng, photos[which])


def corrupt_photos(count: int, rng: np.random.Generator) -> Iterator[tuple[str, bytes, str]]:
    sample = jpeg_bytes(Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)))
    for index in range(count):
        kind = PHOTO_CORRUPT_KINDS[index % len(PHOTO_CORRUPT_KINDS)]
        payload = {
            "zero-bytes": b"",
            "truncated-jpeg": sample[: len(sample) // 2],
            "text-as-jpeg": b"this is a text file that merely ends in .jpg\n" * 4,
        }[kind]
        yield f"{PHOTO_LABELS[index % 2]}/corrupt-{kind}-{index:04d}.jpg", payload, kind


def seed(
    to_uri: str,
    corrupt: int = 0,
    synthetic: int = 0,
    size: int = 32,
    seed: int = 0,
    photos: int = 0,
    digits: bool = True,
    digit_count: int | None = None,
) -> SeedResult:
    """Write the sample objects under ``to_uri``; returns what was written.

    ``digit_count`` writes only the first that many digits (all 1,797 by default): every class is among the first
    hundred, so a smaller set still has them all. With ``photos``, the broken objects are broken JPEGs.
    """
    rng = np.random.default_rng(seed)
    target = storage.normalize(to_uri)
    result = SeedResult(uri=target)
    wanted = dict(itertools.islice(digit_objects(size), digit_count)) if digits else {}
    result.digits = len(wanted)
    for key, data, kind in corrupt_photos(corrupt, rng) if photos else corrupt_objects(corrupt, size, rng):
        wanted[key] = data
        result.corrupt[key] = kind
    synthetic_images = dict(synthetic_objects(synthetic, size, rng))
    photo_images = dict(photo_objects(photos, rng))
    result.synthetic, result.photos = len(synthetic_images), len(photo_images)
    wanted |= synthetic_images | photo_images
    result.written = _write_missing(target, wanted)
    result.skipped = len(wanted) - result.written
    return result


def sample_photos() -> Iterator[tuple[str, bytes]]:
    """scikit-learn's two real JPEG photos (china, flower), re-encoded as JPEG."""
    for index, photo in enumerate(source_photos()):
        yield f"photos/photo-{index}.jpg", jpeg_bytes(photo, 90)


def seed_incoming(to_uri: str, corrupt: int = 4, seed_value: int = 1) -> SeedResult:
    """A day of arrivals for batch inference: the digits, the two sample photos, broken objects."""
    result = seed(to_uri)
    rng = np.random.default_rng(seed_value)
    extra = dict(sample_photos())  # real photos, nothing like the digits
    result.photos = len(extra)
    for key, data, kind in corrupt_objects(corrupt, 32, rng):
        extra[key] = data
        result.corrupt[key] = kind
    _write_missing(result.uri, extra)
    return result


def _write_missing(target: str, objects: dict[str, bytes]) -> int:
    """Write the objects not already present with the same size (their etags stay put); how many were written."""
    present = {o.key: o.size for o in storage.list_objects(target)}
    missing = {key: data for key, data in objects.items() if present.get(key) != len(data)}
    if not missing:
        return 0
    fs, base = storage.filesystem(target)
    paths = {f"{base}/{key}": data for key, data in missing.items()}
    if not storage.is_remote(target):
        for parent in {p.rsplit("/", 1)[0] for p in paths}:
            fs.makedirs(parent, exist_ok=True)
    fs.pipe(paths)  # concurrent PUTs on a cloud store
    return len(missing)


def _sklearn_dataset(name: str) -> Any:
    """One of scikit-learn's bundled datasets (offline), or ``ConfigError`` naming the extra that brings it."""
    try:
        from sklearn import datasets
    except ImportError as exc:
        raise ConfigError(
            f"the demo's data (scikit-learn's digits and sample photos) needs scikit-learn: {install_hint('train')}"
        ) from exc
    return getattr(datasets, name)
