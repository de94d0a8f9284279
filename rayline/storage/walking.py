"""Walking a prefix, on S3 or local disk: one level (objects and sub-prefixes), or everything below.

What :mod:`rayline.storage.listing` builds its parts from: each walker yields
:class:`Entry` objects with keys relative to the listed prefix, page by page
(S3's ``ListObjectsV2``, a local ``scandir``), never a whole listing, in the
order of their keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rayline import storage


@dataclass(frozen=True)
class Entry:
    """One listed object, its key relative to the listed prefix."""

    key: str
    size: int
    etag: str
    modified: str


def _local_etag(size: int, mtime: float) -> str:
    # local files have no ETag: size and mtime identify a version, as HTTP servers do (storage._etag's form)
    return f"{size:x}-{int(mtime * 1e9):x}"


def _local_entry(root: str, entry: os.DirEntry[str]) -> Entry:
    st = entry.stat()
    key = os.path.relpath(entry.path, root).replace(os.sep, "/")
    modified = datetime.fromtimestamp(st.st_mtime, UTC).isoformat()
    return Entry(key, st.st_size, _local_etag(st.st_size, st.st_mtime), modified)


def _local_level(root: str, rel: str) -> Iterator[Entry | str]:
    """The files and folders directly in ``root/rel``, in the order of their keys (a folder's as ``name/``)."""
    try:
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            entries = sorted(it, key=lambda e: e.name + "/" if e.is_dir() else e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.is_dir():
            yield f"{rel}/{entry.name}" if rel else entry.name
        elif entry.is_file():
            yield _local_entry(root, entry)


def _local_all(root: str, rel: str, after: str = "") -> Iterator[Entry]:
    for item in _local_level(root, rel):
        if isinstance(item, Entry):
            if item.key > after:
                yield item
        elif not _all_before(item + "/", after):
            yield from _local_all(root, item, after)


def _all_before(prefix: str, after: str) -> bool:
    """Whether every key that starts with ``prefix`` sorts at or before ``after`` (a folder left out whole)."""
    return after > prefix and not after.startswith(prefix)


def _s3_base(root: str) -> str:
    """The key prefix of ``root``'s objects: its key and one slash (none at a bucket's top)."""
    _, key = storage.split_s3(root)
    return key.rstrip("/") + "/" if key.rstrip("/") else ""


def _s3_pages(root: str, rel: str, delimiter: bool, after: str = "") -> Iterator[dict[str, Any]]:
    from botocore.exceptions import ClientError

    bucket, _ = storage.split_s3(root)
    base = _s3_base(root)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": base + rel, **({"Delimiter": "/"} if delimiter else {})}
    if after:
        kwargs["StartAfter"] = base + after
    try:
        yield from storage.s3_client().get_paginator("list_objects_v2").paginate(**kwargs)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
            return  # like a missing folder: nothing listed
        raise storage.storage_error(exc, "listing", f"{root}/{rel}") from exc
    except Exception as exc:
        raise storage.storage_error(exc, "listing", f"{root}/{rel}") from exc


def _s3_entries(root: str, page: dict[str, Any]) -> Iterator[Entry]:
    base = _s3_base(root)
    for obj in page.get("Contents", []):
        full = str(obj["Key"])
        if not full.startswith(base):
            continue
        modified = obj.get("LastModified")
        when = modified.astimezone(UTC).isoformat() if isinstance(modified, datetime) else str(modified or "")
        yield Entry(full[len(base) :], int(obj.get("Size") or 0), str(obj.get("ETag", "")).strip('"'), when)


def _s3_level(root: str, rel: str) -> Iterator[Entry | str]:
    """One level: the objects directly under ``rel``, and its sub-prefixes as S3 names them, their slash kept.

    Keys are opaque: ``a//`` is a sub-prefix of its own below ``a/``, never ``a``
    again, so a key with doubled slashes is listed once, under its own key.
    """
    base = _s3_base(root)
    for page in _s3_pages(root, rel, delimiter=True):
        yield from _s3_entries(root, page)
        for common in page.get("CommonPrefixes", []):
            yield str(common["Prefix"])[len(base) :]


def _s3_all(root: str, rel: str, after: str = "") -> Iterator[Entry]:
    for page in _s3_pages(root, rel, delimiter=False, after=after):
        yield from _s3_entries(root, page)


LevelWalker = Callable[[str, str], Iterator[Entry | str]]
# (root, sub-prefix, after): the objects below the sub-prefix whose keys sort after ``after`` ("": all), in key order
TreeWalker = Callable[[str, str, str], Iterator[Entry]]


def walkers(root: str) -> tuple[LevelWalker, TreeWalker]:
    """The level and tree walkers of ``root``'s storage.

    A sub-prefix is what the level walker named (S3: the key prefix relative
    to ``root``, its slash kept; local disk: the folder's relative path), to be
    passed back to the same storage's walkers as it is. Both walk in key
    order, so ``after`` resumes a walk past the last key taken.
    """
    return (_s3_level, _s3_all) if storage.is_s3(root) else (_local_level, _local_all)
