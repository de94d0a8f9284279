"""Local disk (and any mounted filesystem) behind the same interface as the clouds.

Conditional writes need no server here:

* create: the bytes go to a temp file first, then ``os.link`` publishes it under the final name, failing if
  the name exists (like ``O_EXCL``, but a reader never sees a created file half-written);
* swap: an exclusive ``fcntl.flock`` on a hidden sibling lock file is held around read → compare →
  ``os.replace``. Every swapper takes that lock and nothing here deletes, so a name that exists when the lock
  is taken keeps existing, and nobody changes it while the lock is held.

A file's version for conditional writes is the SHA-256 of its bytes (a swap must therefore write different
bytes); a listing's is its size and modification time, which identify a version without reading it, as HTTP
servers do. A read checked against a listing (:func:`read_as_listed`) takes that version from its handle.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from itertools import islice
from typing import TYPE_CHECKING

from rayline.storage.backends.base import ObjectStore, Page, Stat, Versioned

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    from fsspec import AbstractFileSystem


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def listed_version(size: int, mtime: float) -> str:
    return f"{size:x}-{int(mtime * 1e9):x}"


def stat_version(st: os.stat_result) -> str:
    """A file's listing version from its stat: the formula of every local ETag already stored in tables."""
    return listed_version(st.st_size, st.st_mtime)


def read_as_listed(path: str) -> tuple[bytes, str, str]:
    """The file's bytes, and its listing version before and after reading them, both from the open handle: the
    version of the bytes read even if the name is replaced; the two differ when it was written in place."""
    with open(path, "rb") as handle:
        before = stat_version(os.fstat(handle.fileno()))
        data = handle.read()
        after = stat_version(os.fstat(handle.fileno()))
    return data, before, after


@contextmanager
def _temp_copy(path: str, data: bytes, *, durable: bool) -> Iterator[str]:
    """``data`` in a temp file beside ``path`` (fsynced when ``durable``), removed afterwards unless moved."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: str, data: bytes, *, durable: bool = True) -> None:
    """A temp file in the same folder, then ``os.replace``: all or nothing to a reader."""
    with _temp_copy(path, data, durable=durable) as tmp:
        os.replace(tmp, path)


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock for swapping ``path`` (its lock file is never deleted: that would race)."""
    folder, name = os.path.split(path)
    fd = os.open(os.path.join(folder, f".{name}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


class LocalStore(ObjectStore):
    """Paths are absolute (``rayline.storage.normalize`` makes them so)."""

    scheme = "file"

    def get(self, uri: str) -> Versioned | None:
        try:
            with open(uri, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return None
        return Versioned(data, digest(data))

    def put(self, uri: str, data: bytes) -> str:
        write_atomic(uri, data)
        return digest(data)

    def put_if_absent(self, uri: str, data: bytes) -> str | None:
        with _temp_copy(uri, data, durable=True) as tmp:
            try:
                os.link(tmp, uri)  # atomic, and fails if the name exists
            except FileExistsError:
                return None
        return digest(data)

    def put_if_match(self, uri: str, data: bytes, version: str) -> str | None:
        if not os.path.isdir(os.path.dirname(uri)):
            return None
        with _locked(uri):
            current = self.get(uri)
            if current is None or current.version != version:
                return None
            write_atomic(uri, data)
        return digest(data)

    def delete(self, uri: str) -> None:
        with suppress(FileNotFoundError):
            os.unlink(uri)

    def list_pages(self, prefix_uri: str, *, level: bool = False, after: str = "") -> Iterator[Page]:
        if level:
            items = list(_level(prefix_uri, ""))
            objects = [item for item in items if isinstance(item, Stat) and item.key > after]
            yield Page(objects, [item + "/" for item in items if isinstance(item, str)])
            return
        stats = _below(prefix_uri, "", after)
        while page := list(islice(stats, 1000)):
            yield Page(page)

    def filesystem(self) -> AbstractFileSystem:
        import fsspec

        return fsspec.filesystem("file")

    def arrow_filesystem(self) -> pafs.FileSystem:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem()

    def delta_options(self) -> None:
        return None


def _level(root: str, rel: str) -> Iterator[Stat | str]:
    """The files and folders directly in ``root/rel``, in the order of their keys (a folder's key ends in '/')."""
    try:
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            entries = sorted(it, key=lambda e: e.name + "/" if e.is_dir() else e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        key = f"{rel}/{entry.name}" if rel else entry.name
        if entry.is_dir():
            yield key
        elif entry.is_file():
            st = entry.stat()
            modified = datetime.fromtimestamp(st.st_mtime, UTC).isoformat()
            yield Stat(key, st.st_size, stat_version(st), modified)


def _below(root: str, rel: str, after: str) -> Iterator[Stat]:
    for item in _level(root, rel):
        if isinstance(item, Stat):
            if item.key > after:
                yield item
        elif not (after > item + "/" and not after.startswith(item + "/")):  # a folder wholly before ``after``
            yield from _below(root, item, after)
