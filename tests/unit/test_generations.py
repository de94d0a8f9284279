"""Generations of a committed folder: where a manifest's files are, and what clearing around one keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayline import storage
from rayline.errors import LeaseLost
from rayline.storage import folders, leases, manifests
from rayline.storage.manifests import MANIFEST, IngestManifest

pytestmark = pytest.mark.unit


def _manifest(generation: str | None) -> IngestManifest:
    return IngestManifest(
        source_uri="s3://b/raw",
        content_hash="h",
        object_count=0,
        total_bytes=0,
        fetch_errors=0,
        labels={},
        shards=[],
        generation=generation,
    )


def test_a_manifests_files_are_in_its_folder_or_its_generations_subfolder() -> None:
    uri = "s3://b/ingested/abc/manifest.json"
    assert manifests.files_folder(uri, _manifest(None)) == "s3://b/ingested/abc"
    assert manifests.files_folder(uri, _manifest("0f1e")) == "s3://b/ingested/abc/gen-0f1e"
    assert manifests.generation_folder("s3://b/x", "0f1e") == "s3://b/x/gen-0f1e"


def test_what_belongs_to_a_generation() -> None:
    assert manifests.belongs_to(MANIFEST, None) and manifests.belongs_to(MANIFEST, "a1")
    assert manifests.belongs_to("shards", None) and manifests.belongs_to("summary.json", None)
    assert not manifests.belongs_to("gen-a1", None), "a later generation's files are not the first one's"
    assert manifests.belongs_to("gen-a1", "a1")
    assert not manifests.belongs_to("gen-b2", "a1") and not manifests.belongs_to("shards", "a1")


def test_a_manifest_from_before_generations_reads_as_the_folder_itself(tmp_path: Path) -> None:
    uri = str(tmp_path / "f" / MANIFEST)
    old = _manifest(None).model_dump(mode="json")
    del old["generation"]
    storage.write_json_atomic(uri, old)
    assert manifests.read(uri, IngestManifest).generation is None


def test_a_generation_names_the_fence_of_its_writer() -> None:
    generation = manifests.new_generation(12)
    assert generation.startswith("12-") and manifests.generation_fence(generation) == 12
    assert manifests.generation_fence("0f1e2d3c4b5a") == 0, "written before fences: anyone's to remove"
    assert manifests.generation_of(f"gen-{generation}") == generation and manifests.generation_of("shards") is None


def test_a_commit_removes_earlier_holders_generations_but_the_one_it_replaced(tmp_path: Path) -> None:
    folder = str(tmp_path / "f")
    lease_uri = folders.lease_uri(folder)
    for holder in ("x", "y", "z"):  # three holders before this one: its fence is 4
        assert leases.try_acquire(lease_uri, holder, ttl_s=-1) is not None
    names = {
        "ours": "gen-4-a1",
        "replaced": "gen-2-b2",
        "stale": "gen-3-c3",  # a holder that lost the lease before committing
        "later": "gen-5-d4",  # the holder that took the lease from this one, filling now
        "before fences": "gen-e5",
        "no generation": "shards",
    }
    for name in (MANIFEST, *names.values()):
        storage.write_bytes_atomic(
            storage.join(folder, name, "x") if name != MANIFEST else storage.join(folder, name), b"x"
        )
    with leases.held(lease_uri, "test", ttl_s=30, wait_s=0) as lease:
        assert lease.fencing_token().generation == 4
        removed = folders.remove_superseded(folder, {"4-a1", "2-b2"}, lease)
    assert sorted(removed) == sorted([names["stale"], names["before fences"], names["no generation"]])
    assert storage.list_names(folder) == sorted([MANIFEST, names["ours"], names["replaced"], names["later"]])


def test_a_commit_that_replaced_a_folder_from_before_generations_keeps_its_files(tmp_path: Path) -> None:
    folder = str(tmp_path / "f")
    for name in (MANIFEST, "shards/part-00000.parquet", "summary.json", "gen-1-a1/x"):
        storage.write_bytes_atomic(storage.join(folder, name), b"x")
    with leases.held(folders.lease_uri(folder), "test", ttl_s=30, wait_s=0) as lease:
        assert folders.remove_superseded(folder, {"1-a1", None}, lease) == []


def test_a_commit_replaces_only_the_manifest_its_run_read(tmp_path: Path) -> None:
    """A run that read the manifest before another run committed (it was paused past its ttl) commits nothing."""
    folder = str(tmp_path / "f")
    with leases.held(folders.lease_uri(folder), "test", ttl_s=30, wait_s=0) as lease:
        manifests.commit(folder, _manifest("1-a"), lease, replaces=None)
        _, token = manifests.read_for_switch(folder, IngestManifest, malformed_ok=False)
        manifests.commit(folder, _manifest("1-b"), lease, replaces=token)
        with pytest.raises(LeaseLost, match="another run committed it after this run read it"):
            manifests.commit(folder, _manifest("1-c"), lease, replaces=token)
        with pytest.raises(LeaseLost):
            manifests.commit(folder, _manifest("1-d"), lease, replaces=None)
    assert manifests.read(manifests.manifest_uri(folder), IngestManifest).generation == "1-b"
