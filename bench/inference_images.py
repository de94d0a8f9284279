"""Synthetic inputs for the batch-inference bench: 100k 32 px PNGs generated once, reused.

Under ``$RAYLINE_BENCH_CACHE`` (default /tmp/rayline-bench-inference-cache);
folders of exactly N of them are hard links, made once per size.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

CACHE = Path(os.environ.get("RAYLINE_BENCH_CACHE", "/tmp/rayline-bench-inference-cache"))
IMAGE_SIZE = 32
CHUNK = 10_000
MAX_IMAGES = 100_000


def _write_chunk(chunk: int) -> int:
    """One chunk of synthetic PNGs, with its own seed so that chunks can be made in parallel."""
    import numpy as np

    from rayline.seed import synthetic_objects

    written = 0
    for key, data in synthetic_objects(CHUNK, IMAGE_SIZE, np.random.default_rng(chunk)):
        label, name = key.split("/")
        path = CACHE / "images" / label / f"c{chunk:02d}-{name}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written += 1
    return written


def ensure_images() -> list[Path]:
    """100k synthetic PNGs under CACHE/images, generated once; returned in a fixed order."""
    done = CACHE / f"images-complete-{MAX_IMAGES}"
    if not done.exists():
        print(f"generating {MAX_IMAGES} synthetic {IMAGE_SIZE}px PNGs under {CACHE / 'images'} (once)", flush=True)
        with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
            assert sum(pool.map(_write_chunk, range(MAX_IMAGES // CHUNK))) == MAX_IMAGES
        done.write_text("ok\n")
    return sorted((CACHE / "images").rglob("*.png"))


def input_folder(count: int, images: list[Path]) -> Path:
    """A folder holding exactly ``count`` of the images (hard links, made once per size)."""
    folder = CACHE / f"inputs-{count}"
    done = CACHE / f"inputs-{count}-complete"
    if not done.exists():
        shutil.rmtree(folder, ignore_errors=True)
        for source in images[:count]:
            target = folder / source.relative_to(CACHE / "images")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(source, target)
        done.write_text("ok\n")
    return folder


def warm_page_cache(folder: Path) -> None:
    """Read every file once so that neither side pays for cold disk reads."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: p.read_bytes(), folder.rglob("*.png")))
