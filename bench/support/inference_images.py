"""Synthetic inputs for the batch-inference bench: up to 100k 32 px PNGs generated once, reused.

Under ``$RAYLINE_BENCH_CACHE`` (default /tmp/rayline-bench-inference-cache),
in chunks of 10k made as the sizes asked for need them; folders of exactly N
of them are hard links, made once per size.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
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


def _chunk_done(chunk: int) -> Path:
    return CACHE / f"images-chunk-{chunk:02d}-complete"


def ensure_images(count: int = MAX_IMAGES) -> list[Path]:
    """At least ``count`` synthetic PNGs under CACHE/images, in a fixed order: only the chunks they need are
    generated (once), so that a smoke test does not first generate all 100k images."""
    chunks = range(min(-(-count // CHUNK), MAX_IMAGES // CHUNK))
    everything = (CACHE / f"images-complete-{MAX_IMAGES}").exists()  # the marker of a cache made all at once
    missing = [chunk for chunk in chunks if not everything and not _chunk_done(chunk).exists()]
    if missing:
        print(f"generating {len(missing) * CHUNK} synthetic {IMAGE_SIZE}px PNGs under {CACHE / 'images'} (once)")
        with ProcessPoolExecutor(min(len(missing), os.cpu_count() or 1)) as pool:
            for chunk, written in zip(missing, pool.map(_write_chunk, missing), strict=True):
                assert written == CHUNK
                _chunk_done(chunk).write_text("ok\n")
    return sorted(path for chunk in chunks for path in (CACHE / "images").glob(f"*/c{chunk:02d}-*.png"))


def input_folder(count: int, images: list[Path]) -> Path:
    """A folder holding exactly ``count`` of the images (hard links, made once per size)."""
    return linked_folder(CACHE / f"inputs-{count}", lambda: images[:count], CACHE / "images")


def linked_folder(folder: Path, sources: Callable[[], list[Path]], root: Path) -> Path:
    """``folder`` holding hard links to ``sources()`` at their paths under ``root``; made once (a marker
    beside it says it is complete, so a killed bench makes it again), and only then are they listed."""
    done = folder.with_name(f"{folder.name}-complete")
    if not done.exists():
        shutil.rmtree(folder, ignore_errors=True)
        for source in sources():
            target = folder / source.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(source, target)
        done.write_text("ok\n")
    return folder


def warm_page_cache(folder: Path, pattern: str = "*.png") -> None:
    """Read every file once so that neither side pays for cold disk reads."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: p.read_bytes(), folder.rglob(pattern)))
