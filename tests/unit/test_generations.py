"""Generations of a committed folder: where a manifest's files are, and what clearing around one keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayline import storage
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


def test_clearing_around_a_generation_keeps_it_and_the_manifest_only(tmp_path: Path) -> None:
    folder = str(tmp_path / "f")
    for name in (MANIFEST, "shards/part-00000.parquet", "summary.json", "gen-a1/x", "gen-b2/y"):
        storage.write_bytes_atomic(storage.join(folder, name), b"x")
    with leases.held(folders.lease_uri(folder), "test", ttl_s=30, wait_s=0) as lease:
        folders.clear_except(folder, "a1", lease)
    assert storage.list_names(folder) == ["gen-a1", MANIFEST]
