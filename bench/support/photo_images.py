"""Photos for the compute-bound inference bench: JPEG views of two real photos, generated once, reused.

``rayline.seed.photo_objects`` (random crops, scales, flips and qualities of
scikit-learn's two sample photos, ~10 % over 2 megapixels) in chunks of
``CHUNK``, each with its own seed so that chunks are made in parallel and a
larger size extends a smaller one instead of replacing it. They live under
``$RAYLINE_BENCH_CACHE/photos/c<chunk>/<photo>/photo-<n>.jpg``; a folder of
exactly N of them is hard links, made once per size.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.support.inference_images import CACHE, linked_folder, warm_page_cache

PHOTOS = CACHE / "photos"
CHUNK = 500
_SEED_BASE = 11_000  # chunk c uses default_rng(_SEED_BASE + c): fixed, so every run sees the same photos


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


def warm_photos(folder: Path) -> None:
    """Read every photo once so that neither side pays for cold disk reads."""
    warm_page_cache(folder, "*.jpg")
