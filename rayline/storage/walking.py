"""Walking a prefix, on S3 or local disk: one level (objects and sub-prefixes), or everything below.

What :mod:`rayline.storage.listing` builds its parts from: each walker yields
:class:`Entry` objects with keys relative to the listed prefix, page by page
(S3's ``ListObjectsV2``, a local ``scandir``), never a whole listing.
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
    try:
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in it:
                if entry.is_dir():
                    yield f"{rel}/{entry.name}" if rel else entry.name
                elif entry.is_file():
                    yield _local_entry(root, entry)
    except (FileNotFoundError, NotADirectoryError):
        return


def _local_all(root: str, rel: str) -> Iterator[Entry]:
    stack = [rel]
    while stack:
        current = stack.pop()
        for item in _local_level(root, current):
            if isinstance(item, str):
                stack.append(item)
            else:
                yield item


def _s3_pages(root: str, rel: str, delimiter: bool) -> Iterator[dict[str, Any]]:
    from botocore.exceptions import ClientError

    bucket, key = storage.split_s3(root)
    base = key.rstrip("/")
    prefix = "/".join(p for p in (base, rel) if p) + "/" if (base or rel) else ""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, **({"Delimiter": "/"} if delimiter else {})}
    try:
        yield from storage.s3_client().get_paginator("list_objects_v2").paginate(**kwargs)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
            return  # like a missing folder: nothing listed
        raise storage.storage_error(exc, "listing", f"{root}/{rel}") from exc
    except Exception as exc:
        raise storage.storage_error(exc, "listing", f"{root}/{rel}") from exc


def _s3_entries(root: str, page: dict[str, Any]) -> Iterator[Entry]:
    _, key = storage.split_s3(root)
    base = key.rstrip("/") + "/" if key.rstrip("/") else ""
    for obj in page.get("Contents", []):
        full = str(obj["Key"])
        if not full.startswith(base):
            continue
        modified = obj.get("LastModified")
        when = modified.astimezone(UTC).isoformat() if isinstance(modified, datetime) else str(modified or "")
        yield Entry(full[len(base) :], int(obj.get("Size") or 0), str(obj.get("ETag", "")).strip('"'), when)


def _s3_level(root: str, rel: str) -> Iterator[Entry | str]:
    _, key = storage.split_s3(root)
    base = key.rstrip("/") + "/" if key.rstrip("/") else ""
    for page in _s3_pages(root, rel, delimiter=True):
        yield from _s3_entries(root, page)
        for common in page.get("CommonPrefixes", []):
            yield str(common["Prefix"])[len(base) :].rstrip("/")


def _s3_all(root: str, rel: str) -> Iterator[Entry]:
    for page in _s3_pages(root, rel, delimiter=False):
        yield from _s3_entries(root, page)


def walkers(root: str) -> tuple[Callable[[str, str], Iterator[Entry | str]], Callable[[str, str], Iterator[Entry]]]:
    return (_s3_level, _s3_all) if storage.is_s3(root) else (_local_level, _local_all)
