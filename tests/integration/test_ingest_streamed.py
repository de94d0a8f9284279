"""Ingest on a streamed listing: shards cut from many listing parts, and an ingest from before the listing's
hash changed form recognised by its objects and reused, not fetched again."""

from __future__ import annotations

import hashlib
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ray_workloads import ingest
from rayline import lineage, storage
from rayline.lineage import DatasetRef, LineageRecord
from rayline.seed import seed
from rayline.storage import manifests
from rayline.storage.manifests import IngestManifest

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


def _as_legacy(root: str, new: ingest.IngestResult) -> str:
    """Turn an ingest into one written before rayline-listing-v2: folder named by the sorted listing's sha256,
    a manifest without listing_version, and the lineage record that named it."""
    raw = storage.join(root, "raw")
    objects = sorted(storage.list_objects(raw), key=lambda o: o.key)
    old_hash = hashlib.sha256("".join(f"{o.key}\t{o.etag}\n" for o in objects).encode()).hexdigest()
    legacy = storage.join(root, "ingested", ingest.dataset_id(raw, old_hash))
    shutil.move(new.output_uri, legacy)
    manifest = manifests.read(storage.join(legacy, ingest.MANIFEST), IngestManifest)
    shards = [s.model_copy(update={"uri": s.uri.replace(new.output_uri, legacy)}) for s in manifest.shards]
    body = manifest.model_dump(mode="json") | {"content_hash": old_hash, "shards": [s.model_dump() for s in shards]}
    del body["listing_version"]
    storage.write_json_atomic(storage.join(legacy, ingest.MANIFEST), body)
    lineage.write_record(
        LineageRecord(
            stage="ingest",
            started_at=datetime.now(UTC),
            inputs=[DatasetRef(uri=raw, content_hash=old_hash)],
            outputs=[DatasetRef(uri=storage.join(legacy, ingest.MANIFEST), content_hash=old_hash)],
            code_version="before-v2",
        )
    )
    return legacy


def test_an_ingest_from_before_the_hash_changed_is_recognised_and_its_shards_reused(local_storage: str) -> None:
    seed(storage.join(local_storage, "raw"), corrupt=0)
    legacy = _as_legacy(local_storage, ingest.run(_config(local_storage)))
    again = ingest.run(_config(local_storage))
    assert not again.cached and again.output_uri != legacy
    reused = again.read_shard_uris()
    assert reused and all(uri.startswith(legacy + "/") for uri in reused), "shards reused"
    manifest = manifests.read(again.manifest_uri, IngestManifest)
    assert manifest.listing_version == 2 and manifest.content_hash == again.content_hash
    assert ingest.run(_config(local_storage)).cached  # from now on the new name is found at once

    # a changed input is no old ingest: fetched anew
    storage.write_bytes_atomic(storage.join(local_storage, "raw", "0", "new.png"), b"not the same objects")
    changed = ingest.run(_config(local_storage))
    assert not changed.cached and all(uri.startswith(changed.output_uri + "/") for uri in changed.read_shard_uris())
