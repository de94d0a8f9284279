"""Photos for the compute-bound benches: JPEG views of two real photos and camera-sized ones, generated once.

``rayline.seed.photo_objects`` in chunks of ``CHUNK``, each with its own seed, so that chunks are made in
parallel and a larger size extends a smaller one; under ``$RAYLINE_BENCH_CACHE/photos``. :func:`camera_folder`
mixes in what a phone uploads: a quarter small views, a quarter each 1, 3 and 12 MP camera photos, each
seeded by its number, under ``$RAYLINE_BENCH_CACHE/camera``. A folder of exactly N is hard links.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.support.inference_images import CACHE, linked_folder

PHOTOS = CACHE / "photos"
CHUNK = 500
_SEED_BASE = 11_000  # chunk c uses default_rng(_SEED_BASE + c): fixed, so every run sees the same photos
CAMERA = CACHE / "camera"
CAMERA_KINDS = ("view", "1mp", "3mp", "12mp")  # photo n is CAMERA_KINDS[n % 4]
_CAMERA_SEED = 12_000  # photo n uses default_rng((_CAMERA_SEED, n))
_CAMERA_BATCH = 8  # photos per task: a 12 MP one takes ~1 s to make


def _chunk_done(chunk: int) -> Path:
    return PHOTOS / f"c{chunk:03d}.complete"


def _write_chunk(chunk: int) -> int:
    import numpy as np

    from rayline.seed import photo_objects

    folder = PHOTOS / f"c{chunk:03d}"
    shutil.rmtree(folder, ignore_errors=True)  # a chunk interrupted half-way is made again whole
    written = 0
    for key, data in photo_objects(CHUNK, np.random.default_rng(_SEED_BASE + chunk)):
        path = folder / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written += 1
    _chunk_done(chunk).write_text("ok\n")
    return written


def ensure_photos(count: int) -> list[Path]:
    """At least ``count`` photos under PHOTOS (missing chunks generated); the first ``count``, in a fixed order."""
    chunks = range(-(-count // CHUNK))
    missing = [c for c in chunks if not _chunk_done(c).exists()]
    if missing:
        print(f"generating {len(missing) * CHUNK} photos under {PHOTOS} (once)", flush=True)
        PHOTOS.mkdir(parents=True, exist_ok=True)
        with ProcessPoolExecutor(min(len(missing), os.cpu_count() or 1)) as pool:
            assert sum(pool.map(_write_chunk, missing)) == len(missing) * CHUNK
    # chunk-major order: the first N are the same photos whatever the largest size generated
    return [p for c in chunks for p in sorted((PHOTOS / f"c{c:03d}").rglob("*.jpg"))][:count]


def photo_folder(count: int) -> Path:
    """A folder holding exactly the first ``count`` photos (hard links, made once per size)."""
    return linked_folder(CACHE / f"photo-inputs-{count}", lambda: ensure_photos(count), PHOTOS)


def _camera_path(index: int, root: Path = CAMERA) -> Path:
    label = ("china", "flower")[index // len(CAMERA_KINDS) % 2]  # each kind gets both photos
    return root / label / f"camera-{index:06d}-{CAMERA_KINDS[index % len(CAMERA_KINDS)]}.jpg"


def _write_camera(indices: list[int], root: Path) -> int:
    import numpy as np

    from rayline.seed import camera_photo, photo_variant, source_photos

    china, flower = source_photos()
    for index in indices:
        rng = np.random.default_rng((_CAMERA_SEED, index))
        path = _camera_path(index, root)
        source = china if path.parent.name == "china" else flower
        kind = CAMERA_KINDS[index % len(CAMERA_KINDS)]
        data = photo_variant(source, rng)[0] if kind == "view" else camera_photo(float(kind[:-2]), rng, source)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(path)  # a killed run leaves no half-written photo under the final name
    return len(indices)


def ensure_camera(count: int, root: Path = CAMERA) -> list[Path]:
    """Photos 0 .. count-1 of the mixed set under ``root`` (missing ones generated in parallel), in order."""
    paths = [_camera_path(index, root) for index in range(count)]
    missing = [index for index, path in enumerate(paths) if not path.exists()]
    if missing:
        print(f"generating {len(missing)} photos (views, 1, 3 and 12 MP) under {root} (once)", flush=True)
        batches = [missing[start : start + _CAMERA_BATCH] for start in range(0, len(missing), _CAMERA_BATCH)]
        with ProcessPoolExecutor(min(len(batches), os.cpu_count() or 1)) as pool:
            assert sum(pool.map(_write_camera, batches, [root] * len(batches))) == len(missing)
    return paths


def camera_folder(count: int) -> Path:
    """A folder of the first ``count`` photos of the camera mix (hard links, made once per size)."""
    return linked_folder(CACHE / f"camera-inputs-{count}", lambda: ensure_camera(count), CAMERA)
