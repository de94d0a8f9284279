"""A forced run over a committed folder writes a new generation and switches to it at the commit.

Readers that opened the committed manifest read its files whole while the
forced run writes and after its switch; a forced run that fails leaves the old
output committed, and one stalled past its lease's ttl before its manifest
lands commits nothing over the run that took over. On the session's S3 server
(``fill_once`` alone, no Ray) and through ingest and preprocess on Ray (a
forced ingest refused mid-run by the fault proxy).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from rayline import storage
from rayline.errors import StorageAccessDenied
from rayline.ray_workloads.data import ingest, preprocess
from rayline.seed import digit_objects
from rayline.storage import folders, manifests
from rayline.storage.manifests import IngestManifest
from rayline.testing.fault_proxy_control import FaultProxy
from tests.integration.stalled_commit import fill_with
from tests.support import REPO_ROOT, proxy_in_front

pytestmark = pytest.mark.integration

FAST_LEASE = folders.LeasedOutput(lease_wait_s=5, lease_ttl_s=10)
STALLED_TTL_S = 1.0


class FillFailed(Exception):
    """The forced run's own failure, half way through its files."""


def _commit(
    folder: str, tag: str, *, force: bool, midway: Callable[[], None] | None = None
) -> folders.Committed[IngestManifest]:
    """``fill_once`` whose fill writes two shards tagged ``tag``, calling ``midway()`` between them."""
    return folders.fill_once(
        folder, FAST_LEASE, "a test folder", IngestManifest, reusable=lambda m: True, force=force,
        fill=fill_with(tag, midway),
    )  # fmt: skip


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
    # after the switch the failed run's leftovers are gone; the replaced generation stays for readers inside it
    kept = [f"gen-{first.manifest.generation}", f"gen-{now.generation}"]
    assert storage.list_names(folder) == sorted([manifests.MANIFEST, *kept])
    assert _tags(held) == {"old"}


def test_a_forced_ingest_refused_mid_run_leaves_the_committed_ingest_for_preprocess(
    s3_faults: FaultProxy, s3_storage: str, ray_session: None
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
    assert all(storage.exists(uri) for uri in before_shards), "the replaced generation stays until the next commit"
    # preprocess finds the ingest's current generation through its manifest
    pre_config = preprocess.PreprocessConfig(
        ingest_manifest_uri=before.manifest_uri, output_root=storage.join(s3_storage, "pre")
    )
    done = preprocess.run(pre_config)
    assert done.total_rows == 12 and storage.exists(done.summary_uri)


def test_a_reader_inside_the_replaced_generation_finishes_it_and_the_next_commit_removes_it(s3_storage: str) -> None:
    """A train-model streaming the old shards while a forced run commits reads them all, not a missing one."""
    folder = storage.join(s3_storage, "folder")
    first = _commit(folder, "old", force=False)
    shards = [s.uri for s in manifests.read(first.uri, IngestManifest).shards]
    assert _tags(shards[:1]) == {"old"}  # the reader is half way
    _commit(folder, "new", force=True)
    assert _tags(shards[1:]) == {"old"}, "the replaced generation went under its reader"
    third = _commit(folder, "newer", force=True)
    assert not any(storage.exists(uri) for uri in shards), "two commits later the generation is left"
    assert _tags([s.uri for s in third.manifest.shards]) == {"newer"}


def _wait_for(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_forced_run_stalled_before_its_manifest_lands_commits_nothing_over_the_run_that_took_over(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    """Run A (its own process, behind a second proxy that holds its manifest PUT) passes its last lease check,
    then stalls (SIGSTOP) past its ttl; run B takes the lease and commits; then A's PUT reaches the server."""
    folder = storage.join(s3_storage, "folder")
    _commit(folder, "old", force=False)
    with proxy_in_front(s3_faults.endpoint, hold_regex=r"/manifest\.json$", hold_methods=["PUT"]) as hold:
        env = {**os.environ, "AWS_ENDPOINT_URL": hold.endpoint}
        args = [sys.executable, "-m", "tests.integration.stalled_commit", folder, "a", str(STALLED_TTL_S)]
        run_a = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
        try:
            _wait_for(lambda: hold.stats().get("held", 0) >= 1, "run A's manifest PUT")
            os.kill(run_a.pid, signal.SIGSTOP)  # after its lease check: its renewer stops with it
            run_b = _commit(folder, "b", force=True)  # waits out A's ttl, then takes the lease
            hold.release()  # A's PUT lands after B's commit, as a stalled writer's does
            _wait_for(lambda: hold.stats().get("forwarded", 0) >= hold.stats()["requests"], "A's PUT forwarded")
        finally:
            os.kill(run_a.pid, signal.SIGCONT)
            out, _ = run_a.communicate(timeout=30)
    now = manifests.read(manifests.manifest_uri(folder), IngestManifest)
    assert now.content_hash == "b" and now.generation == run_b.manifest.generation, "A's manifest landed over B's"
    said = json.loads(out.strip().splitlines()[-1])
    assert "refused" in said and "another run committed it after this run read it" in said["refused"], said
    assert _tags([s.uri for s in now.shards]) == {"b"}
    again = _commit(folder, "c", force=False)  # a later run reuses B's commit, and can read it
    assert again.cached and _tags([s.uri for s in again.manifest.shards]) == {"b"}
