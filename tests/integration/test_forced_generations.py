"""A forced run over a committed folder writes a new generation and switches to it at the commit.

Readers that opened the committed manifest read its files whole while the
forced run writes; a forced run that fails leaves the old output committed.
On the session's S3 server (``fill_once`` alone, no Ray) and through ingest
and preprocess on Ray (a forced ingest refused mid-run by the fault proxy).
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from ray_workloads import ingest, preprocess
from rayline import storage
from rayline.errors import StorageAccessDenied
from rayline.seed import digit_objects
from rayline.storage import folders, manifests
from rayline.storage.manifests import IngestManifest, ShardInfo
from rayline.testing.s3_proxy import S3Proxy

pytestmark = pytest.mark.integration

FAST_LEASE = folders.LeasedOutput(lease_wait_s=5, lease_ttl_s=10)


class FillFailed(Exception):
    """The forced run's own failure, half way through its files."""


def _write_shards(files: str, tag: str, count: int = 2) -> list[ShardInfo]:
    shards = []
    for i in range(count):
        uri = storage.join(files, "shards", f"part-{i:05d}.parquet")
        size = storage.write_parquet_atomic(uri, pa.table({"tag": [tag] * 3}))
        shards.append(ShardInfo(uri=uri, rows=3, bytes=size, fetch_errors=0))
    return shards


def _manifest(shards: list[ShardInfo], tag: str) -> IngestManifest:
    return IngestManifest(
        source_uri=f"s3://nowhere/{tag}",
        content_hash=tag,
        object_count=3 * len(shards),
        total_bytes=sum(s.bytes for s in shards),
        fetch_errors=0,
        labels={},
        shards=shards,
    )


def _commit(folder: str, tag: str, *, force: bool, midway: object = None) -> folders.Committed[IngestManifest]:
    """``fill_once`` whose fill writes two shards tagged ``tag``, calling ``midway()`` between them."""

    def fill(lease: object, files: str) -> IngestManifest:
        first = _write_shards(files, tag, count=1)
        if callable(midway):
            midway()
        return _manifest(first + _write_shards(files, tag)[1:], tag)

    return folders.fill_once(
        folder, FAST_LEASE, "a test folder", IngestManifest, reusable=lambda m: True, force=force, fill=fill
    )


def _tags(shards: list[str]) -> set[str]:
    return set(storage.read_parquet(shards).column("tag").to_pylist())


def test_readers_of_the_committed_output_read_it_whole_while_a_forced_run_writes_and_after_it_fails(
    s3_storage: str,
) -> None:
    folder = storage.join(s3_storage, "folder")
    first = _commit(folder, "old", force=False)
    held = [s.uri for s in manifests.read(first.uri, IngestManifest).shards]  # a reader's listing, before

    def read_the_old_output() -> None:
        assert _tags(held) == {"old"}, "a file of the committed output changed under its reader"
        assert manifests.read(first.uri, IngestManifest).content_hash == "old", "switched before the commit"

    def fail() -> None:
        read_the_old_output()
        raise FillFailed("the forced run fails half way")

    with pytest.raises(FillFailed):
        _commit(folder, "new", force=True, midway=fail)
    read_the_old_output()  # the failed forced run left the old output committed and whole

    second = _commit(folder, "new", force=True, midway=read_the_old_output)
    assert not second.cached and second.manifest.generation is not None
    now = manifests.read(second.uri, IngestManifest)
    assert now.generation == second.manifest.generation and now.content_hash == "new"
    assert all(s.uri.startswith(manifests.files_folder(second.uri, now) + "/") for s in now.shards)
    assert _tags([s.uri for s in now.shards]) == {"new"}
    # after the switch: the old generation and the failed run's leftovers are gone, only the new one is left
    assert storage.list_names(folder) == sorted([manifests.MANIFEST, f"gen-{now.generation}"])
    assert not any(storage.exists(uri) for uri in held)


def test_a_forced_ingest_refused_mid_run_leaves_the_committed_ingest_for_preprocess(
    s3_faults: S3Proxy, s3_storage: str, ray_session: None
) -> None:
    raw = storage.join(s3_storage, "raw")
    for key, data in list(digit_objects(32))[:12]:
        storage.write_bytes_atomic(storage.join(raw, key), data)
    config = ingest.IngestConfig(source_uri=raw, output_root=storage.join(s3_storage, "ingested"), min_shards=3)
    before = ingest.run(config)
    before_shards = before.read_shard_uris()  # before its manifest is replaced
    forced = config.model_copy(update={"force": True})

    # one object's read refused: the forced run fails after fetching the others into their shards
    s3_faults.configure(always_fail="/raw/0/", fault_kinds=["403"], key_regex="/raw/0/")
    with pytest.raises(StorageAccessDenied):
        ingest.run(forced)
    s3_faults.reset()

    still = ingest.read_manifest(before.manifest_uri)
    assert still.read_shard_uris() == before_shards and still.committed_by == before.committed_by
    assert storage.read_parquet(before_shards).num_rows == 12, "the committed shards were cleared"

    again = ingest.run(forced)
    assert again.manifest_uri == before.manifest_uri and not set(again.read_shard_uris()) & set(before_shards)
    assert not any(storage.exists(uri) for uri in before_shards), "the superseded generation is left"
    # preprocess finds the ingest's current generation through its manifest (the old shards are gone)
    pre_config = preprocess.PreprocessConfig(
        ingest_manifest_uri=before.manifest_uri, output_root=storage.join(s3_storage, "pre")
    )
    done = preprocess.run(pre_config)
    assert done.total_rows == 12 and storage.exists(done.summary_uri)
