"""Results of bounded size: what a run returns to Prefect holds counts, digests and versions, whatever N.

An ingest's result here, from a manifest of a 10 M-object night (a night's
own result: tests/integration/test_prediction_tables.py, which runs one).
The list of shards stays in the manifest, on storage.
"""

from __future__ import annotations

import json
import math

import pytest

from ray_workloads import ingest
from ray_workloads.ingest import IngestResult
from rayline import storage
from rayline.storage.manifests import IngestManifest, ShardInfo

pytestmark = pytest.mark.unit

MAX_RESULT_BYTES = 64 * 1024


def _committed(root: str, objects: int, shard_rows: int) -> tuple[str, IngestManifest]:
    """A committed ingest manifest of ``objects`` in shards of ``shard_rows``, its shards not written."""
    folder = storage.join(root, "ingested", "x")
    shards = [
        ShardInfo(
            uri=storage.join(folder, "shards", f"part-{i:05d}.parquet"),
            rows=min(shard_rows, objects - i * shard_rows),
            bytes=4096 * shard_rows,
            fetch_errors=0,
        )
        for i in range(math.ceil(objects / shard_rows))
    ]
    manifest = IngestManifest(
        source_uri=storage.join(root, "raw"),
        content_hash="f" * 64,
        object_count=objects,
        total_bytes=4096 * objects,
        fetch_errors=3,
        labels={f"n{i:08d}": objects // 1000 for i in range(1000)},  # ImageNet's 1,000 classes
        shards=shards,
        skipped={storage.SKIP_HIDDEN: 12, storage.SKIP_FOLDER_MARKER: 2},
        skipped_examples={storage.SKIP_HIDDEN: [f"_tmp/{i}.png" for i in range(5)], storage.SKIP_FOLDER_MARKER: ["a/"]},
    )
    uri = storage.join(folder, "manifest.json")
    storage.write_json_atomic(uri, manifest.model_dump(mode="json"))
    return uri, manifest


def test_an_ingest_result_of_10_million_objects_in_20_000_shards_stays_under_64_kb(local_storage: str) -> None:
    uri, manifest = _committed(local_storage, objects=10_000_000, shard_rows=500)
    assert len(manifest.shards) == 20_000
    result = ingest.read_manifest(uri)
    assert result.shard_count == 20_000 and result.object_count == 10_000_000
    size = len(result.model_dump_json())
    assert size < MAX_RESULT_BYTES, size
    # no field holds a list that grows with the input, nor does the lineage it declares
    assert not [name for name, value in result.model_dump().items() if isinstance(value, list)]
    assert all(len(examples) <= 5 for examples in result.skipped_examples.values())
    (output,) = result.lineage_outputs()
    assert output.facets == {"shard_count": 20_000}


def test_an_ingest_result_is_the_same_size_for_20_shards_or_20_000(local_storage: str) -> None:
    few = ingest.read_manifest(_committed(storage.join(local_storage, "a"), objects=10_000_000, shard_rows=500_000)[0])
    many = ingest.read_manifest(_committed(storage.join(local_storage, "b"), objects=10_000_000, shard_rows=500)[0])
    assert (few.shard_count, many.shard_count) == (20, 20_000)
    # the same objects: only the digits of the shard count differ
    assert abs(len(many.model_dump_json()) - len(few.model_dump_json())) < 16


def test_the_shards_of_an_ingest_result_are_read_from_its_manifest(local_storage: str) -> None:
    uri, manifest = _committed(local_storage, objects=1_200, shard_rows=500)
    result = ingest.read_manifest(uri)
    assert result.shard_count == 3
    assert result.read_shards() == manifest.shards
    assert result.read_shard_uris() == [s.uri for s in manifest.shards]


def test_a_result_persisted_with_its_list_of_shards_still_loads_as_a_count() -> None:
    # what an IngestResult was before: a row per shard (a cached task result or a flow's persisted result)
    old = {
        "source_uri": "s3://b/raw",
        "output_uri": "s3://b/ingested/x",
        "manifest_uri": "s3://b/ingested/x/manifest.json",
        "content_hash": "abc",
        "object_count": 5,
        "total_bytes": 500,
        "fetch_errors": 0,
        "labels": {"3": 5},
        "shards": [
            {"uri": f"s3://b/ingested/x/shards/part-{i:05d}.parquet", "rows": 1, "bytes": 100, "fetch_errors": 0}
            for i in range(5)
        ],
    }
    loaded = IngestResult.model_validate_json(json.dumps(old))
    assert loaded.shard_count == 5 and "shards" not in loaded.model_dump()
    assert IngestResult.model_validate(old) == loaded
