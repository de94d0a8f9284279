"""A night's listing on S3 and local disk, in Ray tasks: what the listing that held everything found, in parts.

The layout is what users point nights at: day and hour sub-prefixes, hashed
key prefixes, objects directly under the prefix, folder markers (S3) and
hidden names. The old whole-prefix listing (``storage.list_inputs``) is the
oracle: the same objects with the same ETags, the same skips per reason.
"""

from __future__ import annotations

import pytest

from rayline import storage
from rayline.storage import listing
from rayline.storage.digests import SetDigest
from rayline.testing.s3_server import boto3_client

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest) -> str:
    fixture = "local_storage" if request.param == "local" else "s3_storage"
    return str(request.getfixturevalue(fixture))


def _seed(source: str) -> set[str]:
    keys = {f"dt=2026-11-28/hour={h:02d}/{i}.png" for h in range(11) for i in range(3)}
    keys |= {f"{h:02x}/{i}.jpg" for h in range(10) for i in range(2)} | {"top-0.png", "top-1.png"}
    for key in keys | {".DS_Store", "dt=2026-11-28/_SUCCESS"}:
        storage.write_bytes_atomic(storage.join(source, key), key.encode())
    if source.startswith("s3://"):
        bucket, _, prefix = source.removeprefix("s3://").partition("/")
        for marker in (f"{prefix}/", f"{prefix}/dt=2026-11-28/hour=03/"):
            boto3_client().put_object(Bucket=bucket, Key=marker, Body=b"")
    return keys


def test_the_listing_in_ray_tasks_finds_what_the_whole_listing_found(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = storage.join(root, "incoming")
    keys = _seed(source)
    monkeypatch.setattr(listing, "PREFIXES_PER_GROUP", 4)  # several groups of hour and hash prefixes
    monkeypatch.setattr(listing, "INLINE_OBJECTS", 0)  # every group in a Ray task, however small the prefix
    streamed = listing.list_to_parts(source, storage.join(root, "_staging", "l"), rows_per_part=5)
    assert len({part.name.split("-")[0] for part in streamed.parts}) >= 4, "the sub-prefixes went to several tasks"
    listed = list(listing.iter_objects(streamed))
    whole = storage.list_inputs(source)
    assert {o.key for o in listed} == keys == {o.key for o in whole.objects}
    assert {(o.uri, o.etag, o.size) for o in listed} == {(o.uri, o.etag, o.size) for o in whole.objects}
    assert streamed.skipped == whole.skipped and streamed.uris == SetDigest.of(o.uri for o in whole.objects)
    again = listing.list_to_parts(source, storage.join(root, "_staging", "m"), rows_per_part=50)
    assert again.content_hash == streamed.content_hash


# Keys with doubled slashes, relative to the listed prefix: at its start (a careless join of the prefix and
# a name), in the middle of a key, at the end of a folder, three in a row, and an object whose key ends in them.
SLASHED = ("a/x.png", "a//y.png", "/z.png", "b//c/d.png", "e/f//g.png", "h///i.png", "j/k//")


def _seed_exact(source: str, keys: tuple[str, ...]) -> None:
    """Objects at exactly these keys (``storage.join`` would strip a leading slash)."""
    bucket, prefix = storage.split_s3(source)
    for key in keys:
        boto3_client().put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=key.encode())


@pytest.mark.parametrize("inline", [0, 2, listing.INLINE_OBJECTS])
def test_each_key_with_doubled_slashes_is_listed_once_under_its_own_uri(
    s3_storage: str, monkeypatch: pytest.MonkeyPatch, inline: int
) -> None:
    """S3 keys are opaque: ``a//y.png`` is an object of its own, beside ``a/y.png``, listed once whoever lists it
    (the caller, a Ray task, a night's cutter after the caller stopped inside a sub-prefix)."""
    source = storage.join(s3_storage, "in")
    _seed_exact(source, SLASHED)
    monkeypatch.setattr(listing, "INLINE_OBJECTS", inline)
    monkeypatch.setattr(listing, "FANOUT", 2)  # the sub-prefixes go to groups at the first level
    streamed = listing.list_to_parts(source, storage.join(s3_storage, "_staging", "l"), rows_per_part=3)
    listed = list(listing.iter_objects(streamed))
    assert sorted(o.key for o in listed) == sorted(SLASHED) and streamed.count == len(SLASHED)
    bucket, prefix = storage.split_s3(source)
    for obj in listed:  # the URI names the object's own key, and reads it
        assert obj.uri == f"{source}/{obj.key}" and storage.split_s3(obj.uri) == (bucket, f"{prefix}/{obj.key}")
        assert storage.read_bytes(obj.uri) == obj.key.encode()
    begun = listing.begin_listing(source, storage.join(s3_storage, "_staging", "b"), rows_per_part=3)
    for name, prefixes in begun.groups:
        for _ in listing.list_group_parts(begun.prefix, prefixes, begun.staging, name, begun.rows_per_part):
            pass
    finished = listing.finish_listing(begun)
    assert (finished.count, finished.uris) == (len(SLASHED), streamed.uris)
