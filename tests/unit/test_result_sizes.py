"""Results of bounded size: what a run returns to Prefect holds counts, digests and versions, whatever N.

An ingest's and a preprocess's result here, from manifests of 10 M objects
(a night's own result: tests/integration/test_night_at_scale.py, which
runs one). The lists of shards and files stay in the manifests, on storage.
"""

from __future__ import annotations

import json
import math

import pytest

from rayline import storage
from rayline.ray_workloads.data import ingest, preprocess
from rayline.specs import ImageSpec, SplitFractions
from rayline.storage.manifests import (
    IngestManifest,
    PreprocessManifest,
    PreprocessParameters,
    PreprocessSummary,
    ShardInfo,
)

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


# A preprocess's result: the files per split stay in its manifest, the result counts them.

FILES_PER_SPLIT = 20_000


def _preprocessed(root: str, files_per_split: int, classes: int = 100) -> tuple[str, PreprocessManifest]:
    """A committed preprocess manifest of ``files_per_split`` files in each split and errors, none of them written."""
    folder = storage.join(root, "preprocessed", "x-1234abcd")
    names = [f"n{i:08d}" for i in range(classes)]
    counts = {"train": 8_000_000, "val": 1_000_000, "test": 1_000_000}
    summary = PreprocessSummary(
        classes=names,
        counts=counts,
        class_counts={s: {c: n // classes for c in names} for s, n in counts.items()},
        error_count=5_000,
        error_types={"ImageDecodeError": 4_990, "ObjectChangedError": 10},
        files={
            part: [storage.join(folder, part, f"part-{i:05d}.parquet") for i in range(files_per_split)]
            for part in (*preprocess.SPLITS, preprocess.ERRORS)
        },
    )
    manifest = PreprocessManifest(
        input_manifest_uri=storage.join(root, "ingested", "x", "manifest.json"),
        input_content_hash="f" * 64,
        output_uri=folder,
        parameters=PreprocessParameters(image=ImageSpec(), splits=SplitFractions()),
        summary=summary,
    )
    uri = storage.join(folder, "manifest.json")
    storage.write_json_atomic(uri, manifest.model_dump(mode="json"))
    return uri, manifest


def test_a_preprocess_result_of_20_000_files_per_split_stays_under_64_kb(local_storage: str) -> None:
    uri, manifest = _preprocessed(local_storage, FILES_PER_SPLIT)
    assert sum(len(uris) for uris in manifest.summary.files.values()) == 4 * FILES_PER_SPLIT
    result = preprocess.read_manifest(uri)
    assert result.file_counts == {
        "train": FILES_PER_SPLIT,
        "val": FILES_PER_SPLIT,
        "test": FILES_PER_SPLIT,
        "errors": FILES_PER_SPLIT,
    }
    size = len(result.model_dump_json())
    assert size < MAX_RESULT_BYTES, size
    # no field holds a list that grows with the input: the only list is the classes, one name per class
    assert [name for name, value in result.model_dump().items() if isinstance(value, list)] == ["classes"]
    assert "files" not in result.model_dump()
    (output,) = result.lineage_outputs()
    assert output.facets["file_counts"] == result.file_counts
    assert not [name for name, value in output.facets.items() if isinstance(value, list)]
    assert len(json.dumps(output.facets)) < 1024


def test_a_preprocess_result_is_the_same_size_for_20_files_per_split_or_20_000(local_storage: str) -> None:
    few = preprocess.read_manifest(_preprocessed(storage.join(local_storage, "a"), 20)[0])
    many = preprocess.read_manifest(_preprocessed(storage.join(local_storage, "b"), FILES_PER_SPLIT)[0])
    assert (few.file_counts["train"], many.file_counts["train"]) == (20, FILES_PER_SPLIT)
    # the same rows in a thousand times as many files: only the digits of the four file counts differ
    assert abs(len(many.model_dump_json()) - len(few.model_dump_json())) < 16


def test_the_files_of_a_preprocess_result_are_read_from_its_manifest(local_storage: str) -> None:
    uri, manifest = _preprocessed(local_storage, 3)
    result = preprocess.read_manifest(uri)
    assert result.file_counts == {part: 3 for part in manifest.summary.files}
    assert result.read_files() == manifest.summary.files
