"""The streamed listing: parts, digests that do not depend on order, skips counted; compaction's grouping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rayline import storage
from rayline.errors import StorageError
from rayline.ray_workloads.nightly.compaction import check_rows, plan_groups
from rayline.storage import listing
from rayline.storage.digests import SetDigest, combine

pytestmark = pytest.mark.unit


def _tree(root: Path) -> set[str]:
    """Hashed sub-prefixes, a deeper day/hour layout, flat objects and names that are no inputs."""
    keys = {f"{h:02x}/img-{i}.png" for h in range(12) for i in range(7)}
    keys |= {f"dt=2026-11-28/hour={h:02d}/p{i}.jpg" for h in range(3) for i in range(4)}
    keys |= {f"flat-{i}.png" for i in range(9)}
    for key in keys | {".hidden.png", "_SUCCESS", "0a/_tmp.png"}:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode())
    return keys


def test_a_listing_streams_into_parts_and_finds_every_input_once(tmp_path: Path) -> None:
    keys = _tree(tmp_path / "in")
    streamed = listing.list_to_parts(str(tmp_path / "in"), str(tmp_path / "staging"), rows_per_part=10)
    assert all(part.rows <= 10 for part in streamed.parts) and len(streamed.parts) > len(keys) // 10
    listed = list(listing.iter_objects(streamed))
    assert sorted(o.key for o in listed) == sorted(keys) and streamed.count == len(keys)
    old = storage.list_inputs(str(tmp_path / "in"))  # the listing that held everything: same objects, same skips
    assert {(o.uri, o.etag, o.size) for o in old.objects} == {(o.uri, o.etag, o.size) for o in listed}
    assert streamed.skipped == old.skipped == {storage.SKIP_HIDDEN: 3}
    assert streamed.uris == SetDigest.of(o.uri for o in old.objects)
    names = [part.name for part in streamed.parts]
    assert len(set(names)) == len(names) and all(os.path.exists(part.uri) for part in streamed.parts)


def test_the_content_hash_is_a_function_of_the_set_of_objects(tmp_path: Path) -> None:
    _tree(tmp_path / "in")
    hashes = {
        listing.list_to_parts(str(tmp_path / "in"), str(tmp_path / f"s{n}"), rows_per_part=n).content_hash
        for n in (1, 7, 1000)
    }
    assert len(hashes) == 1
    (first,) = hashes
    (tmp_path / "in" / "flat-3.png").write_bytes(b"changed, and so its ETag")
    assert listing.list_to_parts(str(tmp_path / "in"), str(tmp_path / "s9")).content_hash != first
    (tmp_path / "in" / "new.png").write_bytes(b"an arrival")
    assert listing.list_to_parts(str(tmp_path / "in"), str(tmp_path / "s10")).content_hash != first


def test_listing_the_same_objects_twice_gives_the_same_parts(tmp_path: Path) -> None:
    _tree(tmp_path / "in")
    a, b = (listing.list_to_parts(str(tmp_path / "in"), str(tmp_path / s), rows_per_part=8) for s in ("a", "b"))
    assert [(p.name, p.rows, p.uris) for p in a.parts] == [(p.name, p.rows, p.uris) for p in b.parts]


def test_a_begun_listing_leaves_groups_whose_parts_finish_it_as_the_whole_listing_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A night lists its first objects in the driver and leaves the other groups of sub-prefixes to its
    cutters (list_group_parts, streamed part by part); the finished listing is the one list_to_parts makes."""
    keys = _tree(tmp_path / "in")
    whole = listing.list_to_parts(str(tmp_path / "in"), str(tmp_path / "whole"), rows_per_part=10)
    # a level's objects come first (a store lists a page's objects, then its sub-prefixes): the 11 names at the
    # top (9 inputs, 2 hidden), then 00/ whole and 01/ up to its 2nd object make the 20 listed inline
    monkeypatch.setattr(listing, "INLINE_OBJECTS", 20)
    begun = listing.begin_listing(str(tmp_path / "in"), str(tmp_path / "staging"), rows_per_part=10)
    assert not begun.complete and begun.own.count < len(keys) and begun.own_prefixes == 2
    # the rest of 01/, then 02/ to 0b/ and dt=…/, a group each: fewer sub-prefixes than LISTERS
    assert [prefixes for _, prefixes in begun.groups][:2] == [[("01/", "01/img-1.png")], [("02/", "")]]
    assert [name for name, _ in begun.groups] == [f"g{n:05d}" for n in range(1, 13)]
    # the 11 sub-prefixes not begun as many objects each as the 2 begun, on average
    assert begun.estimated_count == begun.own.count + begun.own.count * 11 // 2
    with pytest.raises(StorageError, match="no summary of its group g00001"):
        listing.finish_listing(begun)  # a group never listed to its end
    streamed = [
        part
        for name, prefixes in begun.groups
        for part in listing.list_group_parts(begun.prefix, prefixes, begun.staging, name, begun.rows_per_part)
    ]
    assert all(0 < p.rows <= 10 and os.path.exists(p.uri) for p in streamed)
    assert sum(p.rows for p in streamed) == len(keys) - begun.own.count
    finished = listing.finish_listing(begun)
    assert (finished.count, finished.uris, finished.content_hash) == (whole.count, whole.uris, whole.content_hash)
    assert finished.skipped == whole.skipped == {storage.SKIP_HIDDEN: 3}
    assert sorted(o.key for o in listing.iter_objects(finished)) == sorted(keys)
    monkeypatch.undo()
    small = listing.begin_listing(str(tmp_path / "in"), str(tmp_path / "small"))  # under INLINE_OBJECTS: whole
    assert small.complete and small.estimated_count == small.own.count


def test_a_missing_prefix_lists_nothing(tmp_path: Path) -> None:
    streamed = listing.list_to_parts(str(tmp_path / "nowhere"), str(tmp_path / "staging"))
    assert streamed.count == 0 and streamed.parts == [] and streamed.skipped == {}


def test_digests_add_up_in_any_order_and_see_a_missing_a_duplicated_and_an_extra_row() -> None:
    uris = [f"s3://b/in/{i}.png" for i in range(1000)]
    listed = SetDigest.of(uris)
    assert combine(SetDigest.of(uris[i : i + 37]) for i in range(0, 1000, 37)) == listed
    assert SetDigest.of(reversed(uris)) == listed and SetDigest.decode(listed.encode()) == listed
    planted = {
        "missing": uris[1:],
        "duplicated": [*uris, uris[5]],
        "extra": [*uris, "s3://b/in/elsewhere.png"],
        "swapped": [*uris[1:], uris[2]],  # as many rows as listed: one missing, another twice
    }
    for what, rows in planted.items():
        with pytest.raises(StorageError, match="refusing to commit"):
            check_rows(listed, SetDigest.of(rows), what)
    check_rows(listed, SetDigest.of(uris), "the night")  # the real thing passes


def test_compaction_groups_reach_the_file_size_except_one_per_table() -> None:
    sizes = [(f"p{i:03d}", rows, rows * 100) for i, rows in enumerate([40, 70, 0, 10, 100, 5, 3])]
    groups = plan_groups(sizes, min_rows=100, min_bytes=10**9)
    assert groups == [["p000", "p001"], ["p003", "p004", "p005", "p006"]]  # p002 has no rows of this kind
    rows = dict((name, n) for name, n, _ in sizes)
    assert all(sum(rows[p] for p in group) >= 100 for group in groups)
    assert plan_groups([("p0", 3, 10)], 100, 10**9) == [["p0"]]  # a small night: one small file
    assert plan_groups([("p0", 3, 500)], 100, 400) == [["p0"]]  # bytes reach the size first
    assert plan_groups([], 100, 100) == []


def test_the_caller_lists_about_its_bound_of_objects_and_spreads_the_rest_over_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 folders of 10 objects, a bound of 5: the caller stops inside the first folder and hands its rest and
    the other 23 folders, in groups for several listers, to the night's cutters; the finished listing is the
    whole one, and a second listing of the same objects begins the same (the night's blocks are found by it)."""
    keys = {f"f{f:02d}/o{i}.png" for f in range(24) for i in range(10)}
    for key in keys:
        (tmp_path / "in" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / key).write_bytes(key.encode())
    whole = listing.list_to_parts(str(tmp_path / "in"), str(tmp_path / "whole"), rows_per_part=4)
    monkeypatch.setattr(listing, "INLINE_OBJECTS", 5)
    begun = listing.begin_listing(str(tmp_path / "in"), str(tmp_path / "staging"), rows_per_part=4)
    assert begun.own.count <= 5, f"the caller listed {begun.own.count} objects, over its bound of 5"
    assert len(begun.groups) >= listing.LISTERS, "the rest is spread over groups for several listers"
    assert begun.estimated_count >= begun.own.count
    again = listing.begin_listing(str(tmp_path / "in"), str(tmp_path / "again"), rows_per_part=4)
    facts = [(b.groups, b.estimated_count, b.own.uris) for b in (begun, again)]
    assert facts[0] == facts[1]
    for name, prefixes in begun.groups:
        for _ in listing.list_group_parts(begun.prefix, prefixes, begun.staging, name, begun.rows_per_part):
            pass
    finished = listing.finish_listing(begun)
    assert (finished.count, finished.uris, finished.content_hash) == (whole.count, whole.uris, whole.content_hash)
