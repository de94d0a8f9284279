"""Storage URIs: one place that turns a URI into the filesystems Ray needs.

URIs are either local paths (``/data/x``, ``./x``, ``file:///x``) or
``s3://bucket/prefix``. S3 endpoints come from settings (``AWS_ENDPOINT_URL``);
credentials are left to botocore / the AWS SDK so they never pass through here.

Small files (JSON, manifests, Parquet shards) are written atomically: a reader
sees the old object or the new one, never half of one.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any
from urllib.parse import urlparse

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayline.config import get_settings, malformed_s3_uri
from rayline.errors import InputDataError, StorageError, TransientStorageError, is_transient

S3 = "s3://"


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its URI, key relative to the listed prefix, and version facts."""

    uri: str
    key: str
    size: int
    etag: str
    last_modified: str


def is_s3(uri: str) -> bool:
    return uri.startswith(S3)


def _refuse_malformed_s3(uri: str) -> None:
    if (problem := malformed_s3_uri(uri)) is not None:
        raise InputDataError(problem)


def normalize(uri: str) -> str:
    """Absolute, scheme-explicit form: local paths become absolute, no trailing slash.

    A URI starting with ``s3:`` that is not ``s3://bucket[/prefix]`` is refused
    (:func:`rayline.config.malformed_s3_uri`), never taken for a local path.
    """
    _refuse_malformed_s3(uri)
    if is_s3(uri):
        return uri.rstrip("/")
    if uri.startswith("file://"):
        uri = urlparse(uri).path
    if "://" in uri:
        raise InputDataError(f"unsupported storage URI {uri!r}: use a local path or s3://bucket/prefix")
    return os.path.abspath(os.path.expanduser(uri))


def join(base: str, *parts: str) -> str:
    """Join path segments onto a URI with '/' whatever the OS; a mistyped S3 base is refused as by :func:`normalize`."""
    _refuse_malformed_s3(base)
    clean = [p.strip("/") for p in parts if p and p.strip("/")]
    return posixpath.join(base.rstrip("/"), *clean) if clean else base.rstrip("/")


def object_uri(prefix_uri: str, key: str) -> str:
    """The URI of the object at ``key`` (relative to ``prefix_uri``): the key as it is, every slash kept.

    Not :func:`join`, which strips the slashes around each part: S3 keys are
    opaque, and ``//x.png`` (a careless join of a prefix and a name),
    ``a//b.png`` or ``a/b//`` are objects of their own, each read by its URI.
    """
    return f"{prefix_uri.rstrip('/')}/{key}"


def storage_root() -> str:
    """The configured storage root in normalized form."""
    return normalize(get_settings().storage)


def _strip_scheme(uri: str) -> str:
    return uri[len(S3) :] if is_s3(uri) else normalize(uri)


@lru_cache(maxsize=8)
def _s3fs(endpoint_url: str | None, region: str | None) -> fsspec.AbstractFileSystem:
    client_kwargs: dict[str, Any] = {}
    if endpoint_url:
        client_kwargs["endpoint_url"] = endpoint_url
    if region:
        client_kwargs["region_name"] = region
    # listings are always fresh: a stale cache would hide new arrivals
    return fsspec.filesystem("s3", client_kwargs=client_kwargs, use_listings_cache=False, skip_instance_cache=True)


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """An fsspec filesystem for ``uri`` and the path to use with it."""
    if is_s3(uri):
        settings = get_settings()
        return _s3fs(settings.aws_endpoint_url, settings.aws_region), _strip_scheme(uri)
    return fsspec.filesystem("file"), normalize(uri)


@lru_cache(maxsize=8)
def _arrow_s3(endpoint_url: str | None, region: str | None) -> pafs.S3FileSystem:
    kwargs: dict[str, Any] = {"region": region or "us-east-1"}
    if endpoint_url:
        parsed = urlparse(endpoint_url)
        kwargs["endpoint_override"] = parsed.netloc or endpoint_url
        kwargs["scheme"] = parsed.scheme or "https"
    return pafs.S3FileSystem(**kwargs)


def arrow_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem (what Ray Data's readers take) and the path to use with it."""
    if is_s3(uri):
        settings = get_settings()
        return _arrow_s3(settings.aws_endpoint_url, settings.aws_region), _strip_scheme(uri)
    return pafs.LocalFileSystem(), normalize(uri)


def storage_error(exc: Exception, action: str, uri: str) -> Exception:
    """The rayline error to raise ``from exc`` when ``action`` on ``uri`` failed."""
    if isinstance(exc, FileNotFoundError):
        return InputDataError(f"{action} {uri}: not found")
    if is_transient(exc):
        return TransientStorageError(f"{action} {uri}: {type(exc).__name__}: {exc}")
    return StorageError(f"{action} {uri}: {type(exc).__name__}: {exc}")


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    try:
        return bool(fs.exists(path))
    except Exception as exc:
        raise storage_error(exc, "checking", uri) from exc


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    try:
        return bytes(fs.cat_file(path))
    except Exception as exc:
        raise storage_error(exc, "reading", uri) from exc


def write_bytes_atomic(uri: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` so that readers see either nothing/the old object or all of it.

    Local: a temp file in the same folder, fsynced (unless not ``durable``:
    scratch files that a reader checks anyway, such as a night's blocks), then
    ``os.replace``. S3: a single PUT is already atomic for readers.
    """
    fs, path = filesystem(uri)
    try:
        if is_s3(uri):
            fs.pipe_file(path, data)
            return
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                if durable:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except Exception as exc:
        raise storage_error(exc, "writing", uri) from exc


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
        try:
            tables.append(pq.read_table(path, filesystem=fs, columns=columns))
        except Exception as exc:
            raise storage_error(exc, "reading", uri) from exc
    return pa.concat_tables(tables) if tables else pa.table({})


def remove_tree(uri: str) -> None:
    """Delete everything under ``uri``; a missing prefix is not an error."""
    fs, path = filesystem(uri)
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except FileNotFoundError:
        return
    except Exception as exc:
        raise storage_error(exc, "deleting", uri) from exc


def list_folders(uri: str) -> list[str]:
    """Names of the folders directly under ``uri`` (S3: its common prefixes), sorted; none when it is missing.

    One listing of one level: for looking at a folder's layout without listing
    everything below it (a table's data files).
    """
    return sorted(name for name, kind in _one_level(uri) if kind == "directory")


def list_names(uri: str) -> list[str]:
    """Names of the files and folders directly under ``uri``, sorted; none when it is missing (one level)."""
    return sorted(name for name, _ in _one_level(uri))


def _one_level(uri: str) -> list[tuple[str, str]]:
    """(name, type) of each entry directly under ``uri``; none when it is missing."""
    uri = normalize(uri)
    fs, path = filesystem(uri)
    try:
        entries: list[dict[str, Any]] = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    except Exception as exc:
        raise storage_error(exc, "listing", uri) from exc
    return [(posixpath.basename(str(e["name"]).rstrip("/")), str(e.get("type"))) for e in entries]


def _etag(info: dict[str, Any]) -> str:
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return str(etag).strip('"')
    # local files have no ETag: size and mtime identify a version, as HTTP servers do
    mtime = info.get("mtime") or info.get("created") or 0
    return f"{int(info.get('size') or 0):x}-{int(float(mtime) * 1e9):x}"


def _last_modified(info: dict[str, Any]) -> str:
    value = info.get("LastModified") or info.get("mtime")
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC).isoformat()
    return str(value or "")


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

    Keys are relative to the prefix, so a dataset keeps its identity when the
    storage root moves. Not inputs, counted per reason so a run can say what it
    left out: a key with a part that starts with ``.`` or ``_`` (Spark's
    ``_SUCCESS``, editors' and uploaders' temp files), and a zero-byte key that
    ends in ``/`` (a folder marker: also the prefix's own, ``prefix/``). Local
    disk has no folder markers: an empty folder is not listed at all.
    """
    prefix_uri = normalize(prefix_uri)
    fs, path = filesystem(prefix_uri)
    try:
        found: dict[str, dict[str, Any]] = fs.find(path, detail=True)
    except FileNotFoundError:
        found = {}
    except Exception as exc:
        raise storage_error(exc, "listing", prefix_uri) from exc
    base = path.rstrip("/") + "/"
    objects = []
    skipped: dict[str, list[str]] = {}
    for full, info in sorted(found.items()):
        if info.get("type") == "directory" or not full.startswith(base):
            continue
        key, size = full[len(base) :], int(info.get("size") or 0)
        reason = skip_reason(key, size)
        if reason is not None:
            skipped.setdefault(reason, []).append(key or "./")  # "./": the listed prefix's own marker
            continue
        objects.append(ObjectInfo(object_uri(prefix_uri, key), key, size, _etag(info), _last_modified(info)))
    return Listing(
        objects=objects,  # sorted by key: the paths share the prefix
        skipped={reason: len(keys) for reason, keys in sorted(skipped.items())},
        skipped_examples={reason: keys[:_EXAMPLES_PER_REASON] for reason, keys in sorted(skipped.items())},
    )


def list_objects(prefix_uri: str) -> list[ObjectInfo]:
    """The objects of :func:`list_inputs`, for rayline's own folders.

    There a hidden name (``.tmp-…``, ``_SUCCESS``, ``_delta_log``) is rayline's
    own bookkeeping, never worth reporting; listings of users' data use
    :func:`list_inputs`, which counts what it leaves out.
    """
    return list_inputs(prefix_uri).objects


@lru_cache(maxsize=8)
def _s3_client(endpoint_url: str | None, region: str | None, pool: int, attempts: int) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=pool,
        # standard mode retries throttling, 5xx and dropped connections with backoff
        retries={"mode": "standard", "total_max_attempts": attempts},
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


def s3_client(pool: int = 10) -> Any:
    """A botocore S3 client for the configured endpoint (shared, thread-safe)."""
    settings = get_settings()
    return _s3_client(settings.aws_endpoint_url, settings.aws_region, pool, settings.s3_max_attempts)


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len(S3) :].partition("/")
    return bucket, key
