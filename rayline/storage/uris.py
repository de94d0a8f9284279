"""Storage URIs: one place that turns a URI into the store and filesystems that hold it.

URIs are local paths (``/data/x``, ``./x``, ``file:///x``), ``s3://bucket/prefix``, ``gs://bucket/prefix``
or ``az://container/prefix``; each names its backend in :mod:`rayline.storage.backends`. Credentials are left
to each cloud's SDK so they never pass through here. Small files (JSON, manifests, Parquet shards) are written
atomically: a reader sees the old object or the new one, never half of one.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayline.config import get_settings, malformed_store_uri, unsupported_scheme
from rayline.errors import InputDataError, StorageError, TransientStorageError, is_transient
from rayline.storage.backends import CLOUD_SCHEMES, ObjectStore, scheme_of, store_for
from rayline.storage.backends.base import split
from rayline.storage.backends.local import write_atomic


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its URI, key relative to the listed prefix, and version facts."""

    uri: str
    key: str
    size: int
    etag: str
    last_modified: str


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names an object store (S3, GCS, Azure) rather than a local path."""
    return scheme_of(uri) in CLOUD_SCHEMES


def _refuse_malformed(uri: str) -> None:
    if (problem := malformed_store_uri(uri)) is not None:
        raise InputDataError(problem)


def normalize(uri: str) -> str:
    """Absolute, scheme-explicit form: local paths become absolute, no trailing slash. A malformed cloud URI
    (:func:`rayline.config.malformed_store_uri`) is refused, never taken for a local path; so is a scheme rayline
    has no backend for."""
    _refuse_malformed(uri)
    if is_remote(uri):
        return uri.rstrip("/")
    if uri.startswith("file://"):
        uri = urlparse(uri).path
    if (problem := unsupported_scheme(uri)) is not None:
        raise InputDataError(problem)
    return os.path.abspath(os.path.expanduser(uri))


def store(uri: str) -> ObjectStore:
    """The object store that holds ``uri`` (the seam's face: bytes, conditional writes, listings)."""
    return store_for(normalize(uri))


def uri_of_path(path: str, like: str) -> str:
    """The URI of ``path``, a path on the filesystem :func:`filesystem` gave for ``like`` (``bucket/key``)."""
    return f"{scheme_of(like)}://{path.lstrip('/')}" if is_remote(like) else path


def hadoop_uri(uri: str) -> str:
    """``uri`` as the Hadoop-style tools (MLflow, OpenLineage's naming) spell it: Azure's
    ``az://container/key`` becomes ``wasbs://container@<account>.blob.core.windows.net/key``; others are kept."""
    if scheme_of(uri) != "az":
        return uri
    container, _, key = uri[len("az://") :].partition("/")
    account = store_for(uri).account  # type: ignore[attr-defined]
    return f"wasbs://{container}@{account}.blob.core.windows.net/{key}".rstrip("/")


def endpoint_of(uri: str) -> str | None:
    """Where the store of ``uri`` is served, when not by the cloud itself (an emulator, a gateway); None else."""
    return store(uri).endpoint


def join(base: str, *parts: str) -> str:
    """Join path segments onto a URI with '/' whatever the OS; a mistyped cloud base is refused as by
    :func:`normalize`."""
    _refuse_malformed(base)
    clean = [p.strip("/") for p in parts if p and p.strip("/")]
    return posixpath.join(base.rstrip("/"), *clean) if clean else base.rstrip("/")


def object_uri(prefix_uri: str, key: str) -> str:
    """The URI of the object at ``key`` (relative to ``prefix_uri``): the key as it is, every slash kept. Not
    :func:`join`, which strips them: keys are opaque, and ``//x.png`` or ``a//b.png`` are objects of their own."""
    return f"{prefix_uri.rstrip('/')}/{key}"


def storage_root() -> str:
    """The configured storage root in normalized form."""
    return normalize(get_settings().storage)


def _strip_scheme(uri: str) -> str:
    """The path of ``uri`` for its store's filesystems: ``bucket/key`` for a cloud URI, the absolute path else."""
    return uri.partition("://")[2] if is_remote(uri) else normalize(uri)


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """An fsspec filesystem for ``uri`` (its store's client and policy) and the path to use with it."""
    uri = normalize(uri)
    return store_for(uri).filesystem(), _strip_scheme(uri)


def arrow_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem (what Ray Data's readers take) and the path to use with it, with the store's policy."""
    uri = normalize(uri)
    return store_for(uri).arrow_filesystem(), _strip_scheme(uri)


def delta_options(uri: str) -> dict[str, str] | None:
    """delta-rs's storage options for a table at ``uri``: its store's endpoint, and the one retry policy."""
    return store_for(normalize(uri)).delta_options()


def delta_write_refusal(uri: str) -> str | None:
    """Why delta-rs must not write a table at ``uri``, decided without a request; None: it may try."""
    return store_for(normalize(uri)).delta_write_refusal()


def storage_error(exc: Exception, action: str, uri: str) -> Exception:
    """The rayline error to raise ``from exc`` when ``action`` on ``uri`` failed."""
    if isinstance(exc, FileNotFoundError):
        return InputDataError(f"{action} {uri}: not found")
    if is_transient(exc):
        return TransientStorageError(f"{action} {uri}: {type(exc).__name__}: {exc}")
    return StorageError(f"{action} {uri}: {type(exc).__name__}: {exc}")


@contextmanager
def storage_errors(action: str, uri: str) -> Iterator[None]:
    """Run the body; what ``action`` on ``uri`` raised comes out as :func:`storage_error`'s rayline error."""
    try:
        yield
    except Exception as exc:  # each store's client raises its own classes (botocore, aiohttp, gcsfs, Azure, OSError)
        raise storage_error(exc, action, uri) from exc


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    with storage_errors("checking", uri):
        return bool(fs.exists(path))


def read_bytes(uri: str) -> bytes:
    """The bytes of the object at ``uri``, exactly that key (a cloud key's trailing slash is part of it)."""
    uri = uri if is_remote(uri) and malformed_store_uri(uri) is None else normalize(uri)
    with storage_errors("reading", uri):
        found = store_for(uri).get(uri)
    if found is None:
        raise InputDataError(f"reading {uri}: not found")
    return found.data


def write_bytes_atomic(uri: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` so that readers see either nothing/the old object or all of it. Local: a temp file,
    fsynced unless not ``durable`` (scratch files that a reader checks anyway), then ``os.replace``. A cloud
    store: a single PUT is already atomic for readers."""
    uri = normalize(uri)
    with storage_errors("writing", uri):
        if is_remote(uri):
            store_for(uri).put(uri, data)
        else:
            write_atomic(uri, data, durable=durable)


def write_json_atomic(uri: str, payload: Any) -> None:
    data = json.dumps(payload, indent=2, sort_keys=True, default=str).encode()
    write_bytes_atomic(uri, data + b"\n")


def read_json(uri: str) -> Any:
    raw = read_bytes(uri)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputDataError(f"{uri} is not valid JSON: {exc}") from exc


def write_parquet_atomic(uri: str, table: pa.Table, *, durable: bool = True) -> int:
    """Write ``table`` as one Parquet file atomically; returns the file's size in bytes."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    data = buffer.getvalue()
    write_bytes_atomic(uri, data, durable=durable)
    return len(data)


def read_parquet(uris: Iterable[str], columns: list[str] | None = None) -> pa.Table:
    """Read and concatenate small Parquet files (manifests name them; no globbing)."""
    tables = []
    for uri in uris:
        fs, path = arrow_filesystem(uri)
        with storage_errors("reading", uri):
            tables.append(pq.read_table(path, filesystem=fs, columns=columns))
    return pa.concat_tables(tables) if tables else pa.table({})


def remove_tree(uri: str) -> None:
    """Delete everything under ``uri``; a missing prefix is not an error."""
    fs, path = filesystem(uri)
    with storage_errors("deleting", uri), suppress(FileNotFoundError):
        if fs.exists(path):
            fs.rm(path, recursive=True)


def list_folders(uri: str) -> list[str]:
    """Names of the folders directly under ``uri`` (S3: its common prefixes), sorted; none when it is missing:
    one listing of one level, a folder's layout without listing everything below it."""
    return sorted(name for name, kind in _one_level(uri) if kind == "directory")


def list_names(uri: str) -> list[str]:
    """Names of the files and folders directly under ``uri``, sorted; none when it is missing (one level)."""
    return sorted(name for name, _ in _one_level(uri))


def _one_level(uri: str) -> list[tuple[str, str]]:
    """(name, type) of each entry directly under ``uri``; none when it is missing."""
    uri = normalize(uri)
    entries: list[tuple[str, str]] = []
    with storage_errors("listing", uri):
        for page in store_for(uri).list_pages(uri, level=True):
            entries += [(stat.key, "file") for stat in page.objects]
            entries += [(prefix.rstrip("/"), "directory") for prefix in page.prefixes]
    return [(name, kind) for name, kind in entries if name]


# Why a listed object is not an input (the reasons a listing reports).
SKIP_HIDDEN = "hidden or underscore name"
SKIP_FOLDER_MARKER = "folder marker"
_EXAMPLES_PER_REASON = 5


@dataclass(frozen=True)
class Listing:
    """A prefix's objects, and the ones that are not inputs: how many per reason, and the first few keys."""

    objects: list[ObjectInfo]
    skipped: dict[str, int]
    skipped_examples: dict[str, list[str]]


def skip_reason(key: str, size: int) -> str | None:
    """Why the object at ``key`` (relative to a listed prefix) is no input, or None when it is one."""
    if any(part.startswith((".", "_")) for part in key.split("/")):
        return SKIP_HIDDEN
    if (key == "" or key.endswith("/")) and size == 0:
        # what S3 consoles and tools write for a folder ("" is the listed prefix's own): no object of a dataset
        return SKIP_FOLDER_MARKER
    return None


def list_inputs(prefix_uri: str) -> Listing:
    """Every object under ``prefix_uri`` (recursive, sorted by key), and what is not an input.

    Keys are relative to the prefix, so a dataset keeps its identity when the storage root moves. Not inputs
    (:func:`skip_reason`), counted per reason so a run can say what it left out: a key with a part that starts
    with ``.`` or ``_`` (Spark's ``_SUCCESS``, uploaders' temp files), and a folder marker.
    """
    prefix_uri = normalize(prefix_uri)
    objects = []
    skipped: dict[str, list[str]] = {}
    with storage_errors("listing", prefix_uri):
        for page in store_for(prefix_uri).list_pages(prefix_uri):
            for stat in page.objects:
                reason = skip_reason(stat.key, stat.size)
                if reason is not None:
                    skipped.setdefault(reason, []).append(stat.key or "./")  # "./": the listed prefix's own marker
                    continue
                objects.append(
                    ObjectInfo(object_uri(prefix_uri, stat.key), stat.key, stat.size, stat.version, stat.modified)
                )
    return Listing(
        objects=objects,  # sorted by key: every store lists in key order
        skipped={reason: len(keys) for reason, keys in sorted(skipped.items())},
        skipped_examples={reason: keys[:_EXAMPLES_PER_REASON] for reason, keys in sorted(skipped.items())},
    )


def list_objects(prefix_uri: str) -> list[ObjectInfo]:
    """The objects of :func:`list_inputs`, for rayline's own folders, where a hidden name (``.tmp-…``,
    ``_delta_log``) is rayline's own bookkeeping, never worth reporting."""
    return list_inputs(prefix_uri).objects


def split_s3(uri: str) -> tuple[str, str]:
    return split(uri)
