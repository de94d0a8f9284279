"""Sample data: scikit-learn's real handwritten digits as PNG objects.

``raw/<label>/digit-<id>.png`` for the 1,797 digits, optional broken objects
of several kinds (to exercise per-sample error capture) and optional
synthetic images (for scale). Deterministic for a given seed, and
idempotent: objects already present with the same size are not rewritten,
so their etags (and the ingest content hash) stay put.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from rayline import storage

CORRUPT_KINDS = ("zero-bytes", "truncated-png", "text-as-png", "binary-as-png")
# the error type preprocess must record for each kind of broken object
EXPECTED_ERROR_TYPE = {
    "zero-bytes": "EmptyImageError",
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
    from sklearn.datasets import load_digits

    digits = load_digits()
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


def seed(to_uri: str, corrupt: int = 0, synthetic: int = 0, size: int = 32, seed: int = 0) -> SeedResult:
    """Write the sample objects under ``to_uri``; returns what was written."""
    rng = np.random.default_rng(seed)
    target = storage.normalize(to_uri)
    result = SeedResult(uri=target)
    wanted: dict[str, bytes] = {}
    for key, data in digit_objects(size):
        wanted[key] = data
        result.digits += 1
    for key, data, kind in corrupt_objects(corrupt, size, rng):
        wanted[key] = data
        result.corrupt[key] = kind
    for key, data in synthetic_objects(synthetic, size, rng):
        wanted[key] = data
        result.synthetic += 1

    present = {o.key: o.size for o in storage.list_objects(target)}
    to_write = {k: v for k, v in wanted.items() if present.get(k) != len(v)}
    result.skipped = len(wanted) - len(to_write)
    _write_many(target, to_write)
    result.written = len(to_write)
    return result


def sample_photos() -> Iterator[tuple[str, bytes]]:
    """scikit-learn's two real JPEG photos (china, flower), re-encoded as JPEG."""
    from sklearn.datasets import load_sample_images

    for index, photo in enumerate(load_sample_images().images):
        buffer = io.BytesIO()
        Image.fromarray(photo).save(buffer, format="JPEG", quality=90)
        yield f"photos/photo-{index}.jpg", buffer.getvalue()


def seed_incoming(to_uri: str, corrupt: int = 4, seed_value: int = 1) -> SeedResult:
    """A day of arrivals for batch inference: the digits, the two sample photos, broken objects."""
    result = seed(to_uri)
    rng = np.random.default_rng(seed_value)
    extra = dict(sample_photos())  # real photos, nothing like the digits
    for key, data, kind in corrupt_objects(corrupt, 32, rng):
        extra[key] = data
        result.corrupt[key] = kind
    present = {o.key: o.size for o in storage.list_objects(result.uri)}
    _write_many(result.uri, {k: v for k, v in extra.items() if present.get(k) != len(v)})
    result.photos = len(list(sample_photos()))
    return result


def _write_many(target: str, objects: dict[str, bytes]) -> None:
    if not objects:
        return
    fs, base = storage.filesystem(target)
    paths = {f"{base}/{key}": data for key, data in objects.items()}
    if not storage.is_s3(target):
        for parent in {p.rsplit("/", 1)[0] for p in paths}:
            fs.makedirs(parent, exist_ok=True)
    fs.pipe(paths)  # concurrent PUTs on S3
