"""The reports batch inference's UDF returns to the driver survive the trip as a Ray Data batch."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from rayline import storage
from rayline.ray_workloads.execution.interface import torch_threads
from rayline.ray_workloads.nightly.blocks import BlockReport, reports_batch, reports_of
from rayline.ray_workloads.nightly.contract import block_size
from rayline.ray_workloads.nightly.holding import listing_staging_uri, night_listings, remove_earlier_listings
from rayline.storage.digests import SetDigest
from rayline.tables.delta_tables import Night

pytestmark = pytest.mark.unit


def test_block_reports_round_trip_through_a_report_batch() -> None:
    uris = [f"/in/{i}.png" for i in range(256)]
    written = [
        BlockReport("g00000-00000/b000000000", 250, 6, 9000, 800, SetDigest.of(uris), {"CorruptImageError": 6}),
        BlockReport("g00000-00000/b000000256", 3, 0, 700, 90, SetDigest.of(uris[:3]), {}, reused=True),
    ]
    batch = pa.table(reports_batch(written))  # what Ray Data makes of the UDF's dict of arrays
    assert [report for row in batch.to_pylist() for report in reports_of(row)] == written


@pytest.mark.parametrize(
    ("side", "count", "chosen", "size"),
    [
        (32, 20_000, None, 256),  # the digits: cheap model calls, large blocks
        (224, 20_000, None, 32),  # a ResNet at 224 px: small blocks keep the tail short
        (224, 3_200_000, None, 32),  # 100,000 blocks: still the base size
        (224, 100_000_000, None, 1_000),  # past 100,000 blocks they grow: the driver's work stays bounded
        (32, 100_000_000, None, 1_000),
        (224, 100_000_000, 16, 16),  # a size the user chose is kept
    ],
)
def test_blocks_grow_past_a_hundred_thousand_a_night(side: int, count: int, chosen: int | None, size: int) -> None:
    assert block_size(side, count, chosen) == size


def test_importing_the_udf_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, rayline.ray_workloads.nightly.batch_inference; assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(("cpus", "threads"), [(0.0, 1), (0.25, 1), (0.5, 1), (1.0, 1), (1.5, 1), (2.0, 2), (4.0, 4)])
def test_an_actor_runs_torch_on_the_whole_cpus_it_holds(cpus: float, threads: int) -> None:
    assert torch_threads(cpus) == threads


def test_decoded_pixels_per_chunk_are_bounded_but_a_chunk_holds_at_least_a_batch() -> None:
    from rayline.ray_workloads.nightly.predictor import DECODED_BYTES_PER_CHUNK, chunk_size

    assert chunk_size(32, 64) >= 256  # the digits: a whole block in one concurrent fetch
    assert 64 <= chunk_size(224, 64) and chunk_size(224, 64) * 3 * 224 * 224 * 4 <= DECODED_BYTES_PER_CHUNK
    assert chunk_size(1024, 64) == 64  # never fewer than one model call's worth


def test_model_calls_are_bounded_by_pixels() -> None:
    from rayline.ray_workloads.nightly.predictor import model_batch_size

    assert model_batch_size(32, 64) == 64  # the digits: as asked
    assert model_batch_size(224, 64) == 8 and model_batch_size(224, 4) == 4  # a CPU: its caches
    assert model_batch_size(224, 64, "cuda") == 32  # a GPU: large batches
    assert model_batch_size(1024, 64) == 1


def test_each_holder_of_a_night_lists_apart_and_clears_only_earlier_holders_listings(tmp_path: Path) -> None:
    root, night = str(tmp_path), Night("digits", "2026-11-27")
    other_night = listing_staging_uri(root, Night("digits", "2026-11-28"), 1, "aaaa")
    dead, paused, own, later = (
        listing_staging_uri(root, night, f, h) for f, h in [(1, "a1"), (2, "b2"), (3, "c3"), (4, "d4")]
    )
    for uri in (other_night, dead, paused, own, later):
        storage.write_bytes_atomic(storage.join(uri, "g00000-00000.parquet"), b"part")
    assert night_listings(root, night) == {dead: 1, paused: 2, own: 3, later: 4}
    remove_earlier_listings(root, night, 3, own)
    # a later holder's listing is not this holder's to remove: the lease it holds was taken over
    assert night_listings(root, night) == {own: 3, later: 4}
    assert storage.exists(storage.join(other_night, "g00000-00000.parquet")), "another night's listing"
