"""Ingest on a streamed listing: shards cut from many listing parts, and an ingest from before the listing's
hash changed form recognised by its objects and reused, not fetched again."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayline import storage
from rayline.ray_workloads.data import ingest
from rayline.seed import seed

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


def _config(root: str, **changes: object) -> ingest.IngestConfig:
    raw, out = storage.join(root, "raw"), storage.join(root, "ingested")
    return ingest.IngestConfig(source_uri=raw, output_root=out).model_copy(update=changes)


def test_shards_cut_from_many_listing_parts_hold_every_object_once(local_storage: str) -> None:
    seeded = seed(storage.join(local_storage, "raw"), corrupt=2)
    result = ingest.run(_config(local_storage, listing_part_objects=100, shard_max_objects=64))
    shards = result.read_shards()
    assert result.object_count == seeded.total and len(shards) == result.shard_count
    assert max(s.rows for s in shards) <= 64
    keys = storage.read_parquet([s.uri for s in shards], columns=["key"]).column("key").to_pylist()
    assert len(keys) == len(set(keys)) == seeded.total
    listed = storage.list_objects(storage.join(local_storage, "raw"))
    assert result.content_hash == ingest.content_hash(listed)  # the streamed hash is the set's, in any order
    assert not Path(local_storage, "ingested", "_staging", "listings").exists() or not any(
        Path(local_storage, "ingested", "_staging", "listings").iterdir()
    ), "the run removed its listing parts"
