"""The storage seam on each backend, against real servers: local disk, S3 (moto), GCS (fake-gcs-server), Azurite.

Every backend answers the same questions the same way: bytes and their
version, create-if-absent and replace-if-match with exactly one winner,
listings streamed in key order with keys kept as written, a pyarrow
filesystem for readers, and delta-rs's options for the tables.
"""

from __future__ import annotations

import io
import threading
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayline import storage
from rayline.errors import ConditionalWritesUnsupported, LeaseLost
from rayline.storage import conditional, conditional_probe, leases
from rayline.storage.backends import store_for
from rayline.testing.gcs_server import gcp_storage_emulator
from tests.conftest import EMULATOR_BUCKET

pytestmark = pytest.mark.integration

BACKENDS = ["local", "s3", "gcs", "azure"]
# Keys a cloud store keeps apart and an uploader may write: empty and dot segments, spaces, escapes. Azure's
# SDK resolves a dot segment in the URL's path before signing it, so no such name reaches Azure as written.
ODD_KEYS = ["a//b.jpg", "sp ace.jpg", "%41.jpg", "q?x=1.jpg"]
DOT_SEGMENT_KEYS = ["a/./c.jpg"]


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh prefix on one backend's server."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    if request.param == "local":
        return str(tmp_path / name)
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/{name}"
    if request.param == "gcs":
        request.getfixturevalue("gcs_emulator")
        return f"gs://{EMULATOR_BUCKET}/{name}"
    request.getfixturevalue("azurite_endpoint")
    return f"az://{EMULATOR_BUCKET}/{name}"


def test_an_object_reads_back_with_its_version_and_a_write_changes_the_version(root: str) -> None:
    store, uri = store_for(root), storage.join(root, "x.json")
    assert store.get(uri) is None
    first = store.put(uri, b"one")
    found = store.get(uri)
    assert found is not None and (found.data, found.version) == (b"one", first)
    second = store.put(uri, b"two")
    assert second != first and store.get(uri) == type(found)(b"two", second)
    store.delete(uri)
    store.delete(uri)  # a missing object is no error
    assert store.get(uri) is None


def test_of_writers_racing_to_create_one_object_exactly_one_wins(root: str) -> None:
    store, uri = store_for(root), storage.join(root, "claim.json")
    results: list[str | None] = []
    writers = [
        threading.Thread(target=lambda i=i: results.append(store.put_if_absent(uri, f"writer {i}".encode())))
        for i in range(6)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1, results
    found = store.get(uri)
    assert found is not None and found.version == winners[0] and found.data.startswith(b"writer ")


def test_a_swap_lands_only_on_the_version_it_read(root: str) -> None:
    store, uri = store_for(root), storage.join(root, "lease.json")
    assert store.put_if_match(uri, b"nothing to swap", "0") is None  # no object: nothing matches
    created = store.put_if_absent(uri, b"generation 1")
    assert created is not None
    swapped = store.put_if_match(uri, b"generation 2", created)
    assert swapped is not None and swapped != created
    assert store.put_if_match(uri, b"generation 3 from a stale read", created) is None
    found = store.get(uri)
    assert found is not None and (found.data, found.version) == (b"generation 2", swapped)


def test_a_listing_streams_every_key_below_the_prefix_in_order_keys_as_written(root: str) -> None:
    store = store_for(root)
    keys = ["b/2.jpg", "a/1.jpg", "c.jpg", "b/sub/3.jpg"]
    keys += [] if root.startswith("/") else ODD_KEYS + ([] if root.startswith("az://") else DOT_SEGMENT_KEYS)
    for key in keys:
        store.put(storage.object_uri(root, key), key.encode())
    listed = [stat for page in store.list_pages(root) for stat in page.objects]
    assert [s.key for s in listed] == sorted(keys)
    for stat in listed:
        found = store.get(storage.object_uri(root, stat.key))
        assert found is not None and found.data == stat.key.encode() and stat.size == len(stat.key)
        if not root.startswith("/"):  # a cloud lists the version a read returns (local disk: size and mtime)
            assert stat.version == found.version
    resumed = [s.key for page in store.list_pages(root, after="b/2.jpg") for s in page.objects]
    assert resumed == [k for k in sorted(keys) if k > "b/2.jpg"]
    level = list(store.list_pages(root, level=True))
    assert sorted(s.key for page in level for s in page.objects) == sorted(k for k in keys if "/" not in k)
    assert {"a/", "b/"} <= {p for page in level for p in page.prefixes}
    assert list(store.list_pages(storage.join(root, "nothing-here"))) in ([], [type(level[0])([], [])])


def test_the_storage_functions_work_on_each_backend_by_uri(root: str) -> None:
    storage.write_json_atomic(storage.join(root, "m", "manifest.json"), {"n": 1})
    assert storage.read_json(storage.join(root, "m", "manifest.json")) == {"n": 1}
    assert storage.exists(storage.join(root, "m", "manifest.json"))
    storage.write_bytes_atomic(storage.join(root, "in", "_SUCCESS"), b"")
    storage.write_bytes_atomic(storage.join(root, "in", "x", "1.jpg"), b"jpeg")
    listing = storage.list_inputs(storage.join(root, "in"))
    assert [o.key for o in listing.objects] == ["x/1.jpg"] and listing.skipped == {storage.SKIP_HIDDEN: 1}
    assert listing.objects[0].uri == storage.join(root, "in", "x", "1.jpg")
    assert storage.list_folders(root) == ["in", "m"]
    storage.remove_tree(storage.join(root, "in"))
    assert storage.list_inputs(storage.join(root, "in")).objects == []


def test_readers_get_a_pyarrow_filesystem_on_the_same_store(root: str) -> None:
    table = pa.table({"key": ["a", "b"], "n": [1, 2]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    uri = storage.join(root, "shards", "0.parquet")
    storage.write_bytes_atomic(uri, buffer.getvalue())
    fs, path = storage.arrow_filesystem(uri)
    assert pq.read_table(path, filesystem=fs).equals(table)
    assert storage.read_parquet([uri]).equals(table)


def test_delta_tables_commit_and_read_with_the_stores_options(root: str) -> None:
    if root.startswith("gs://"):
        pytest.skip(
            "delta-rs writes GCS through object_store's XML API, which no GCS emulator serves "
            "(fake-gcs-server: 'invalid uploadType'; gcp-storage-emulator: no ETag header): docs/storage.md"
        )
    from deltalake import DeltaTable, write_deltalake

    uri = storage.join(root, "tables", "predictions")
    options = storage.delta_options(uri)
    write_deltalake(uri, pa.table({"n": [1, 2]}), storage_options=options)
    write_deltalake(uri, pa.table({"n": [3]}), storage_options=options, mode="append")
    table = DeltaTable(uri, storage_options=options)
    assert table.version() == 1 and sorted(table.to_pyarrow_table().column("n").to_pylist()) == [1, 2, 3]


def test_each_store_passes_the_conditional_write_probe(root: str) -> None:
    conditional_probe.require_conditional_writes(storage.join(root, "leases", "night.lease"))
    assert conditional.create_exclusive(storage.join(root, "claims", "v1"), b"run a") is not None
    assert conditional.create_exclusive(storage.join(root, "claims", "v1"), b"run b") is None
    assert [o.key for o in storage.list_inputs(root).objects] == ["claims/v1"], "the probe leaves nothing behind"


def test_a_gcs_emulator_that_ignores_generation_conditions_is_refused_before_any_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gcp-storage-emulator accepts a second ``ifGenerationMatch=0`` create and a stale generation: the probe
    refuses it, naming both, and the claim is never written."""
    with gcp_storage_emulator([EMULATOR_BUCKET]) as endpoint:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        claim = f"gs://{EMULATOR_BUCKET}/claims/v1"
        with pytest.raises(ConditionalWritesUnsupported) as refused:
            conditional.create_exclusive(claim, b"run a")
        message = str(refused.value)
        assert f"the GS endpoint {endpoint}" in message and "ifGenerationMatch=0" in message
        assert "ifGenerationMatch=<generation>" in message and "Nothing was written" in message
        assert storage.list_inputs(f"gs://{EMULATOR_BUCKET}/claims").objects == []


def test_of_runs_racing_for_a_lease_exactly_one_holds_it_and_a_renewal_fences_the_rest(root: str) -> None:
    uri = storage.join(root, "leases", "dt=2026-12-04.lease")
    taken: list[leases.Lease] = []
    barrier = threading.Barrier(4)

    def race(run: str) -> None:
        barrier.wait()
        if (lease := leases.try_acquire(uri, run, ttl_s=60)) is not None:
            taken.append(lease)

    runs = [threading.Thread(target=race, args=(f"run-{i}",)) for i in range(4)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert len(taken) == 1
    renewed = leases.renew(taken[0])
    assert leases.read(uri) == renewed and leases.release(renewed)
    with pytest.raises(LeaseLost):
        leases.renew(taken[0])  # the stale holder's token no longer matches
