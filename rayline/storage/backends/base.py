"""The object-store interface every backend implements, and the one retry and timeout policy they share.

A backend answers for one scheme and takes whole URIs, so callers never split a URI or build a client. Keys
are opaque: ``a//b.jpg`` and ``a/./b.jpg`` are objects of their own on every cloud, which is one reason the
backends are fsspec's (s3fs, gcsfs, adlfs) and not ``object_store``'s, whose paths refuse them
(bench/storage_clients.py). An object's *version* is what its store changes on every write and checks in a
conditional one: the ETag on S3 and Azure (without its quotes), the generation on GCS, a digest of the bytes
on local disk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow.fs as pafs

from rayline.config import get_settings

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


@dataclass(frozen=True)
class Versioned:
    """An object's bytes and the version of exactly those bytes."""

    data: bytes
    version: str


@dataclass(frozen=True)
class Stat:
    """One listed object: its key relative to the listed prefix, size, version and last change (ISO 8601)."""

    key: str
    size: int
    version: str
    modified: str


@dataclass(frozen=True)
class Page:
    """One page of a listing: objects, and (one level only) sub-prefixes relative to the listed prefix, slash kept."""

    objects: list[Stat]
    prefixes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StoragePolicy:
    """How often and how long every request rayline makes to a store may try, whatever the client: transient
    failures are retried with backoff by the backend's client, and Delta commits by delta-rs, with these
    figures (``max_attempts`` counts the first try)."""

    max_attempts: int
    timeout_s: float
    connect_timeout_s: float

    @classmethod
    def from_settings(cls) -> StoragePolicy:
        settings = get_settings()
        return cls(settings.storage_max_attempts, settings.storage_timeout_s, settings.storage_connect_timeout_s)

    def delta_options(self) -> dict[str, str]:
        """The policy in delta-rs's (``object_store``'s) storage-option names."""
        return {
            "max_retries": str(self.max_attempts - 1),
            "timeout": f"{self.timeout_s:g}s",
            "connect_timeout": f"{self.connect_timeout_s:g}s",
        }


class ObjectStore(ABC):
    """What rayline asks of a store. Methods raise ``OSError`` or the client's own error; the callers in
    ``rayline.storage`` turn those into rayline's (``storage_error``)."""

    scheme: ClassVar[str]
    endpoint: str | None = None  # where the store is served when not the cloud's own (an emulator, a gateway)

    @abstractmethod
    def get(self, uri: str) -> Versioned | None:
        """The object's bytes and version; None when there is no object."""

    @abstractmethod
    def put(self, uri: str, data: bytes) -> str:
        """Write the object whatever is there; its new version."""

    @abstractmethod
    def put_if_absent(self, uri: str, data: bytes) -> str | None:
        """Create the object only if there is none: its version, or None when one existed."""

    @abstractmethod
    def put_if_match(self, uri: str, data: bytes, version: str) -> str | None:
        """Replace the object only if its version is still ``version``: the new version, or None."""

    @abstractmethod
    def delete(self, uri: str) -> None:
        """Remove the object; a missing one is not an error."""

    @abstractmethod
    def list_pages(self, prefix_uri: str, *, level: bool = False, after: str = "") -> Iterator[Page]:
        """The objects below ``prefix_uri`` page by page in key order, keys relative to it. The prefix is
        ``prefix_uri``'s key and a slash; one that ends with a slash already is taken exactly as written (``a//``
        lists only what is below ``a//``, not below ``a/``). ``level``: only those directly under it, with its
        sub-prefixes; ``after``: only keys that sort after this one (a resumed listing)."""

    @abstractmethod
    def filesystem(self) -> AbstractFileSystem:
        """The fsspec filesystem of this store (paths without the scheme), with the store's policy."""

    def arrow_filesystem(self) -> pafs.FileSystem:
        """A pyarrow filesystem for readers and Ray Data with the same policy and credentials: by default the
        store's fsspec filesystem wrapped for pyarrow."""
        return pafs.PyFileSystem(ModifiedTimeHandler(self.filesystem()))

    @abstractmethod
    def delta_options(self) -> dict[str, str] | None:
        """delta-rs's storage options for tables in this store."""

    def delta_write_refusal(self) -> str | None:
        """Why delta-rs must not write tables in this store, known before it makes a request; None: it may try."""
        return None


class ModifiedTimeHandler(pafs.FSSpecHandler):  # type: ignore[misc]
    """pyarrow's fsspec handler, with each cloud's modification time as the files' ``mtime`` (s3fs, gcsfs and
    adlfs name it differently): Delta's add actions need it. A class of this module's, so that the filesystem
    pickles to Ray's workers."""

    @staticmethod
    def _create_file_info(path: str, info: dict[str, Any]) -> pafs.FileInfo:
        found = pafs.FSSpecHandler._create_file_info(path, info)
        if found.mtime is not None or found.type != pafs.FileType.File:
            return found
        modified = info.get("LastModified") or info.get("updated") or info.get("last_modified")
        if isinstance(modified, str):
            modified = datetime.fromisoformat(modified.replace("Z", "+00:00"))
        return pafs.FileInfo(path, found.type, size=found.size, mtime=modified)


def split(uri: str, *, prefix: bool = False) -> tuple[str, str]:
    """(bucket or container, key) of a cloud URI, the key exactly as written: every slash kept. ``prefix``: the
    key is a listing's prefix, with a slash added unless it has one (then it is taken as is)."""
    container, _, key = uri.partition("://")[2].partition("/")
    return container, key + "/" if prefix and key and not key.endswith("/") else key


def first_cause(exc: BaseException, kind: type[Any]) -> Any:
    """The first exception of ``kind`` in ``exc``'s chain of causes, or None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
