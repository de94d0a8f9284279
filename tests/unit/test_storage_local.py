from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from rayline import storage
from rayline.errors import InputDataError, ObjectChangedError
from rayline.skipped import skipped_text
from rayline.storage import fetching
from rayline.storage.backends import local

pytestmark = pytest.mark.unit


def test_join_and_normalize() -> None:
    assert storage.join("s3://b/p/", "a", "/b/") == "s3://b/p/a/b"
    assert storage.normalize("s3://b/p/") == "s3://b/p"
    assert storage.normalize("file:///tmp/x") == "/tmp/x"
    assert os.path.isabs(storage.normalize("./relative"))
    assert storage.normalize("gs://b/p/") == "gs://b/p" and storage.normalize("az://c/p") == "az://c/p"
    with pytest.raises(InputDataError, match="unsupported storage URI"):
        storage.normalize("hdfs://bucket/x")
    with pytest.raises(InputDataError, match="malformed GS URI"):
        storage.join("gs:/bucket", "x")


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    target = str(tmp_path / "deep" / "x.json")
    storage.write_json_atomic(target, {"a": 1})
    storage.write_json_atomic(target, {"a": 2})
    assert storage.read_json(target) == {"a": 2}
    assert os.listdir(tmp_path / "deep") == ["x.json"]


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = str(tmp_path / "x.json")
    storage.write_json_atomic(target, {"ok": True})

    class Unserialisable:
        def __str__(self) -> str:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        storage.write_json_atomic(target, {"bad": Unserialisable()})
    assert storage.read_json(target) == {"ok": True}
    assert os.listdir(tmp_path) == ["x.json"]


def test_list_objects_is_recursive_sorted_and_skips_hidden(tmp_path: Path) -> None:
    for rel in ["b/2.png", "a/1.png", "a/.tmp-x", "_SUCCESS", "c.png"]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"12345")
    listed = storage.list_objects(str(tmp_path))
    assert [o.key for o in listed] == ["a/1.png", "b/2.png", "c.png"]
    assert all(o.size == 5 and o.etag for o in listed)
    assert listed[0].uri == str(tmp_path / "a/1.png")


def test_list_inputs_counts_what_it_leaves_out(tmp_path: Path) -> None:
    for rel in ["a/1.png", ".x/a.png", "_tmp/b.png", "c/_d.png", "c/e.png"]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"12345")
    (tmp_path / "photos").mkdir()  # an empty folder is no object on local disk
    listing = storage.list_inputs(str(tmp_path))
    assert [o.key for o in listing.objects] == ["a/1.png", "c/e.png"]
    assert listing.skipped == {storage.SKIP_HIDDEN: 3}
    assert listing.skipped_examples == {storage.SKIP_HIDDEN: [".x/a.png", "_tmp/b.png", "c/_d.png"]}
    assert skipped_text({storage.SKIP_HIDDEN: 3, storage.SKIP_FOLDER_MARKER: 1}) == (
        "4 (folder marker 1, hidden or underscore name 3)"
    )


def test_missing_prefix_lists_nothing_and_missing_file_is_named(tmp_path: Path) -> None:
    assert storage.list_objects(str(tmp_path / "nope")) == []
    with pytest.raises(InputDataError, match="nope.json: not found"):
        storage.read_json(str(tmp_path / "nope.json"))


def test_parquet_round_trip(tmp_path: Path) -> None:
    uri = str(tmp_path / "t.parquet")
    size = storage.write_parquet_atomic(uri, pa.table({"x": [1, 2, 3]}))
    assert size > 0
    assert storage.read_parquet([uri]).column("x").to_pylist() == [1, 2, 3]


def test_fetch_many_reads_local_files_in_order_in_this_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(name.encode())

    def no_pool(*args: object, **kwargs: object) -> None:
        raise AssertionError("local reads go through no thread pool")

    monkeypatch.setattr(fetching, "ThreadPoolExecutor", no_pool)
    fetched = fetching.fetch_many([str(tmp_path / "b"), str(tmp_path / "missing"), str(tmp_path / "a")], 64)
    assert [f.data for f in fetched] == [b"b", None, b"a"]
    assert isinstance(fetched[1].error, FileNotFoundError)


def test_a_local_read_names_the_version_its_listing_gives_and_a_replaced_file_reads_as_changed(
    tmp_path: Path,
) -> None:
    photo = tmp_path / "x.jpg"
    photo.write_bytes(b"the photo that was labelled")
    (listed,) = storage.list_objects(str(tmp_path))
    (read,) = fetching.fetch_many([listed.uri], 4)
    assert read.etag == listed.etag and fetching.as_listed(read, listed.etag) is read

    photo.write_bytes(b"another photo under the same name")
    (again,) = fetching.fetch_many([listed.uri], 4)
    changed = fetching.as_listed(again, listed.etag)
    assert isinstance(changed.error, ObjectChangedError) and changed.data is None
    assert again.etag == storage.list_objects(str(tmp_path))[0].etag != listed.etag


def test_a_local_file_written_while_it_is_read_is_an_object_changed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    photo = tmp_path / "x.jpg"
    photo.write_bytes(b"first bytes")
    real_fstat = os.fstat
    calls = 0

    def written_after_the_first_look(fd: int) -> os.stat_result:
        nonlocal calls
        calls += 1
        found = real_fstat(fd)
        if calls == 1:  # a writer appends between the handle's first stat and its read
            with open(photo, "ab") as writer:
                writer.write(b" and more")
        return found

    monkeypatch.setattr(local.os, "fstat", written_after_the_first_look)
    (read,) = fetching.fetch_many([str(photo)], 4)
    assert isinstance(read.error, ObjectChangedError) and read.data is None
    assert "written while read" in str(read.error)


def test_a_prefix_of_only_skipped_objects_is_an_error_that_says_what_was_skipped(tmp_path: Path) -> None:
    from rayline.ray_workloads.data import ingest

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "_SUCCESS").write_bytes(b"")
    config = ingest.IngestConfig(source_uri=str(tmp_path / "raw"), output_root=str(tmp_path / "out"))
    with pytest.raises(
        InputDataError, match=r"no objects found under .*raw; skipped 1 \(hidden or underscore name 1\)"
    ):
        ingest.run(config)


@pytest.mark.parametrize(
    "uri",
    ["s3:/bucket/raw", "s3:bucket/raw", "s3://", "s3:///raw", "s3:", "S3://bucket/raw", "s3:\\\\bucket"],
)
def test_a_mistyped_s3_uri_is_refused_naming_the_expected_form(uri: str) -> None:
    with pytest.raises(InputDataError, match=r"expected s3://bucket\[/prefix\]") as info:
        storage.normalize(uri)
    assert repr(uri) in str(info.value)


def test_well_formed_s3_uris_pass_unchanged_but_for_a_trailing_slash() -> None:
    assert storage.normalize("s3://bucket") == "s3://bucket"
    assert storage.normalize("s3://bucket/") == "s3://bucket"
    assert storage.normalize("s3://my.bucket-1/raw/dt=2026-11-28/") == "s3://my.bucket-1/raw/dt=2026-11-28"


@pytest.mark.parametrize("key", ["a/x.png", "a//y.png", "//z.png", "/z.png", "b///c.png", "j/k//"])
def test_an_object_uri_keeps_every_slash_of_its_key_and_splits_back_into_it(key: str) -> None:
    """S3 keys are opaque: a URI made of a key with doubled slashes names that object, not its folded form."""
    uri = storage.object_uri("s3://bucket/in/dt=2026-11-28/", key)
    assert uri == f"s3://bucket/in/dt=2026-11-28/{key}"
    assert storage.split_s3(uri) == ("bucket", f"in/dt=2026-11-28/{key}")
    assert storage.split_s3(storage.object_uri("s3://bucket", key)) == ("bucket", key)


def test_joining_onto_a_mistyped_s3_uri_is_refused() -> None:
    with pytest.raises(InputDataError, match=r"expected s3://bucket\[/prefix\]"):
        storage.join("s3:", "raw")
