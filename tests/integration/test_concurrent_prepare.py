"""Concurrent runs on one input share one content-addressed folder: one fills it, the other waits and reuses it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest

from rayline import storage
from rayline.errors import LeaseBusy, LeaseLost
from rayline.ray_workloads.data import ingest, preprocess
from rayline.seed import seed
from rayline.storage import folders, leases, manifests
from rayline.storage.manifests import IngestManifest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

T = TypeVar("T")


def _at_once(run: Callable[[], T]) -> list[T]:
    """``run`` in two threads released together: both look for the commit before either makes it."""
    start = threading.Barrier(2)

    def go() -> T:
        start.wait()
        return run()

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(go) for _ in range(2)]
        return [f.result() for f in futures]


def _files(folder: str) -> set[str]:
    return {storage.join(folder, o.key) for o in storage.list_objects(folder)}


def _shards(ingested: ingest.IngestResult) -> str:
    """Where the committed generation's shards are."""
    manifest = manifests.read(ingested.manifest_uri, IngestManifest)
    return storage.join(manifests.files_folder(ingested.manifest_uri, manifest), "shards")


def _ingest_config(root: str, **extra: float) -> ingest.IngestConfig:
    return ingest.IngestConfig(
        source_uri=storage.join(root, "raw"), output_root=storage.join(root, "ingested"), **extra
    )


def test_two_concurrent_runs_commit_once_and_the_second_reuses_it(s3_storage: str) -> None:
    """On S3 (conditional PUTs); the flow test below runs on local disk (link and flock)."""
    root = s3_storage
    seed(storage.join(root, "raw"), digits=False, synthetic=60, corrupt=2)

    ingested = _at_once(lambda: ingest.run(_ingest_config(root)))
    assert len({r.manifest_uri for r in ingested}) == 1
    written, reused = sorted(ingested, key=lambda r: r.cached)
    assert not written.cached and reused.cached
    assert reused.waited_s > 0, "the second run waited for the first one's lease"
    assert (reused.shard_count, reused.committed_by) == (written.shard_count, written.committed_by), "one commit"
    # exactly one set of shards, every one the manifest names
    manifest = storage.read_json(written.manifest_uri)
    assert _files(_shards(written)) == {s["uri"] for s in manifest["shards"]}
    assert leases.read(folders.lease_uri(written.output_uri)).released  # type: ignore[union-attr]

    config = preprocess.PreprocessConfig(
        ingest_manifest_uri=written.manifest_uri, output_root=storage.join(root, "pre")
    )
    prepared = _at_once(lambda: preprocess.run(config))
    assert len({r.manifest_uri for r in prepared}) == 1
    written_pre, reused_pre = sorted(prepared, key=lambda r: r.cached)
    assert not written_pre.cached and reused_pre.cached
    assert reused_pre.waited_s > 0
    assert reused_pre.file_counts == written_pre.file_counts
    assert reused_pre.read_files() == written_pre.read_files()
    named = {uri for uris in written_pre.read_files().values() for uri in uris}
    parquet = {f for f in _files(written_pre.output_uri) if f.endswith(".parquet")}
    assert parquet == named, "the manifest names every data file there is, and only those"
    assert sum(written_pre.counts.values()) + written_pre.error_count == 62


def test_a_run_never_clears_a_folder_that_a_live_run_holds(local_storage: str) -> None:
    raw = storage.join(local_storage, "raw")
    seed(raw, digits=False, synthetic=20)
    output = storage.join(
        local_storage, "ingested", ingest.dataset_id(raw, ingest.content_hash(storage.list_objects(raw)))
    )
    other = "flow run other-run (1234) on elsewhere pid 7"
    held = leases.try_acquire(folders.lease_uri(output), other, ttl_s=60, describe="the other run's folder")
    assert held is not None
    generation = manifests.new_generation(held.fencing_token().generation)
    in_progress = storage.join(manifests.generation_folder(output, generation), "shards", "part-00000.parquet")
    storage.write_bytes_atomic(in_progress, b"being written by the other run")

    with pytest.raises(LeaseBusy, match="other-run") as busy:
        ingest.run(_ingest_config(local_storage, lease_wait_s=0.3))
    assert busy.value.holder == other
    assert storage.read_bytes(in_progress) == b"being written by the other run"
    assert not storage.exists(storage.join(output, ingest.MANIFEST))

    # once the holder is gone, its uncommitted leftovers are replaced
    assert leases.release(held)
    result = ingest.run(_ingest_config(local_storage, lease_wait_s=0.3))
    assert not result.cached and result.object_count == 20
    assert _files(_shards(result)) == set(result.read_shard_uris())
    assert not storage.exists(in_progress)


@pytest.mark.usefixtures("prefect_api")
def test_two_concurrent_prepare_data_runs_both_complete(local_storage: str) -> None:
    """A prepare-data run, and one as retraining runs it (a subflow announcing no retrain), on one input at once."""
    from prefect import flow
    from prefect.client.schemas.objects import State

    from rayline.flows.prepare_data import PrepareDataResult, PrepareRequest, prepare_data

    @flow(name="retrain-like")
    def retrain_like() -> PrepareDataResult:
        return prepare_data(PrepareRequest(announce_retrain=False))

    seed(storage.join(local_storage, "raw"), digits=False, synthetic=60, corrupt=2)
    runs: list[Callable[[], State[PrepareDataResult]]] = [
        lambda: prepare_data(return_state=True),
        lambda: retrain_like(return_state=True),
    ]
    start = threading.Barrier(2)

    def go(run: Callable[[], State[PrepareDataResult]]) -> State[PrepareDataResult]:
        start.wait()
        return run()

    with ThreadPoolExecutor(2) as pool:
        states = list(pool.map(go, runs))
    assert all(s.is_completed() for s in states), [s.message for s in states]
    results = [s.result() for s in states]
    assert len({r.ingest.manifest_uri for r in results}) == 1
    assert len({r.preprocess.manifest_uri for r in results}) == 1
    # one run filled each folder; the other reused its commit (at once, or after waiting for its lease)
    assert sorted(r.ingest.cached for r in results) == [False, True]
    assert sorted(r.preprocess.cached for r in results) == [False, True]
    ingested = results[0].ingest
    assert _files(_shards(ingested)) == set(ingested.read_shard_uris())
    prepared = results[0].preprocess
    named = {uri for uris in prepared.read_files().values() for uri in uris}
    assert {f for f in _files(prepared.output_uri) if f.endswith(".parquet")} == named


def test_a_run_that_lost_its_lease_commits_nothing(local_storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(storage.join(local_storage, "raw"), digits=False, synthetic=20)
    proofs: list[str] = []

    def lost_at_the_commit(self: leases.HeldLease) -> leases.Lease:
        proofs.append(self.lease.uri)  # the first proof is the commit's
        raise LeaseLost("another run took the lease over while this one was paused")

    monkeypatch.setattr(leases.HeldLease, "ensure_held", lost_at_the_commit)
    with pytest.raises(LeaseLost):
        ingest.run(_ingest_config(local_storage))
    assert len(proofs) == 1
    output = proofs[0].removesuffix(folders.LEASE_SUFFIX)
    assert storage.list_objects(output), "the shards were written"
    assert not storage.exists(storage.join(output, ingest.MANIFEST))
