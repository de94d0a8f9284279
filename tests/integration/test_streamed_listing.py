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
    if storage.is_s3(source):
        bucket, _, prefix = source.removeprefix(storage.S3).partition("/")
        for marker in (f"{prefix}/", f"{prefix}/dt=2026-11-28/hour=03/"):
            storage.s3_client().put_object(Bucket=bucket, Key=marker, Body=b"")
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
