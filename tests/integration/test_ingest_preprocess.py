"""Ingest and preprocess workloads on a real Ray cluster."""

from __future__ import annotations

import re

import pytest

from rayline import storage
from rayline.errors import InputDataError
from rayline.ray_workloads.data import ingest, preprocess
from rayline.seed import seed
from rayline.storage import manifests
from rayline.storage.manifests import IngestManifest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


def _run(root: str, force: bool = False) -> tuple[ingest.IngestResult, preprocess.PreprocessResult]:
    ingested = ingest.run(
        ingest.IngestConfig(
            source_uri=storage.join(root, "raw"), output_root=storage.join(root, "ingested"), force=force
        )
    )
    prepared = preprocess.run(
        preprocess.PreprocessConfig(
            ingest_manifest_uri=ingested.manifest_uri, output_root=storage.join(root, "pre"), force=force
        )
    )
    return ingested, prepared


def test_rerun_on_unchanged_input_reuses_output_and_force_rewrites_same_files(local_storage: str) -> None:
    seed(storage.join(local_storage, "raw"), corrupt=3)
    first_ingest, first = _run(local_storage)
    files_before = {o.key for o in storage.list_objects(local_storage)}
    again_ingest, again = _run(local_storage)
    assert again_ingest.cached and again.cached
    assert again_ingest.content_hash == first_ingest.content_hash
    assert {o.key for o in storage.list_objects(local_storage)} == files_before
    manifest_before = storage.read_json(first_ingest.manifest_uri)

    forced_ingest, forced = _run(local_storage, force=True)
    assert not forced.cached
    assert forced_ingest.content_hash == first_ingest.content_hash
    assert forced_ingest.manifest_uri == first_ingest.manifest_uri and forced.manifest_uri == first.manifest_uri
    # the same files again, in a new generation of each folder that replaced the old one at the commit
    # (the manifest read before the forced run: the same URI now names its commit)
    manifest = storage.read_json(forced_ingest.manifest_uri)
    assert manifest["generation"] and manifest["generation"] != manifest_before["generation"]
    differing = ("generation", "shards", "committed_by")  # the forced run is another holder
    assert {k: v for k, v in manifest.items() if k not in differing} == {
        k: v for k, v in manifest_before.items() if k not in differing
    }
    # the replaced generations stay for their readers until the next commit, beside the new ones
    current = (manifest["generation"], storage.read_json(forced.manifest_uri)["generation"])
    files_after = {o.key for o in storage.list_objects(local_storage)}
    of_current = {k for k in files_after if "/gen-" not in k or any(f"/gen-{g}/" in k for g in current)}
    assert len(of_current) == len(files_before) and files_before < files_after
    assert {_without_generation(key) for key in of_current} == {_without_generation(key) for key in files_before}


def _without_generation(key: str) -> str:
    return re.sub(r"/gen-[0-9]+-[0-9a-f]+/", "/", key)


def test_new_objects_change_the_hash_but_keep_existing_splits(local_storage: str) -> None:
    raw = storage.join(local_storage, "raw")
    seed(raw)
    _, before = _run(local_storage)
    seed(raw, synthetic=20)
    _, after = _run(local_storage)
    assert after.input_content_hash != before.input_content_hash
    assert after.output_uri != before.output_uri
    assert after.counts["train"] + after.counts["val"] + after.counts["test"] == 1797 + 20
    assert all(after.counts[s] >= before.counts[s] for s in before.counts)


def test_uncommitted_leftovers_are_replaced(local_storage: str) -> None:
    raw = storage.join(local_storage, "raw")
    seed(raw)
    objects = storage.list_objects(raw)
    output = storage.join(local_storage, "ingested", ingest.dataset_id(raw, ingest.content_hash(objects)))
    storage.write_bytes_atomic(storage.join(output, "shards", "part-99999.parquet"), b"half-written junk")
    ingested, _ = _run(local_storage)
    assert not storage.exists(storage.join(output, "shards", "part-99999.parquet"))
    files = manifests.files_folder(ingested.manifest_uri, manifests.read(ingested.manifest_uri, IngestManifest))
    assert len(storage.list_objects(storage.join(files, "shards"))) == ingested.shard_count


def test_empty_prefix_is_a_clear_error(local_storage: str) -> None:
    with pytest.raises(InputDataError, match="no objects found under .*nothing-here"):
        ingest.run(
            ingest.IngestConfig(source_uri=storage.join(local_storage, "nothing-here"), output_root=local_storage)
        )
