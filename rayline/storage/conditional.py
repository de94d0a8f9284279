"""Conditional writes: create-if-absent and compare-and-swap on one small object.

The one implementation behind the registry's version claims and the leases
of ``rayline.storage.leases``. Every object written here has a *token* that changes
with its content: on S3 its ETag, on local disk the SHA-256 of its bytes.

S3: ``PutObject`` with ``If-None-Match: *`` (create) or ``If-Match: <etag>``
(swap); S3 answers 412 PreconditionFailed or 409 ConditionalRequestConflict
to the loser. An endpoint that ignores those headers would answer 200 to
every writer: the first conditional write to a bucket probes it
(``rayline.storage.conditional_probe``) and refuses to go on if it does. Local disk:

* create: the bytes go to a temp file first, then ``os.link`` publishes it
  under the final name, failing if the name exists (like ``O_EXCL``, but a
  reader never sees a created file half-written);
* swap: an exclusive ``fcntl.flock`` on a hidden sibling lock file is held
  around read → compare → ``os.replace``. Every swapper takes that lock and
  nothing here deletes, so a name that exists when the lock is taken keeps
  existing, and nobody changes it while the lock is held.

Tokens are derived from content, so a swap must write bytes that differ from
the ones it replaces (leases carry a generation number that grows with each
write); two writes of identical bytes would look like no write at all. For
the same reason the bytes should name their writer: after a retried S3 PUT,
finding exactly one's own bytes is how a write that landed is recognised.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rayline import storage
from rayline.storage.conditional_probe import error_code, require_conditional_writes

# S3's answers to a conditional write that lost, and to one on a missing key
_NOT_APPLIED = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409", "NoSuchKey", "404"})
_CONFLICT = frozenset({"ConditionalRequestConflict", "409"})
_CONFLICT_ATTEMPTS = 3


@dataclass(frozen=True)
class Versioned:
    """An object's bytes and the token of exactly those bytes."""

    data: bytes
    token: str


def create_exclusive(uri: str, data: bytes) -> str | None:
    """Write ``uri`` only if it does not exist: its token, or None if it existed already."""
    if storage.is_s3(uri):
        return _put_s3(uri, data, IfNoneMatch="*")
    return _create_local(storage.normalize(uri), data)


def read_versioned(uri: str) -> Versioned | None:
    """The object's bytes and token; None when there is no object."""
    if storage.is_s3(uri):
        return _read_s3(uri)
    return _read_local(storage.normalize(uri))


def replace_if_match(uri: str, data: bytes, token: str) -> str | None:
    """Replace ``uri`` with ``data`` only if its token is still ``token``: the new token, or None."""
    if storage.is_s3(uri):
        return _put_s3(uri, data, IfMatch=f'"{token}"')  # an entity tag is quoted on the wire
    path = storage.normalize(uri)
    with _locked(path):
        current = _read_local(path)
        if current is None or current.token != token:
            return None
        storage.write_bytes_atomic(path, data)
    return _token(data)


def _token(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _create_local(path: str, data: bytes) -> str | None:
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    except OSError as exc:
        raise storage.storage_error(exc, "creating", path) from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)  # atomic, and fails if the name exists
        return _token(data)
    except FileExistsError:
        return None
    except OSError as exc:
        raise storage.storage_error(exc, "creating", path) from exc
    finally:
        os.unlink(tmp)


def _read_local(path: str) -> Versioned | None:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise storage.storage_error(exc, "reading", path) from exc
    return Versioned(data=data, token=_token(data))


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock for swapping ``path`` (its lock file is never deleted: that would race)."""
    folder, name = os.path.split(path)
    try:
        fd = os.open(os.path.join(folder, f".{name}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise storage.storage_error(exc, "locking", path) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _read_s3(uri: str) -> Versioned | None:
    bucket, _, key = uri[len(storage.S3) :].partition("/")
    try:
        response = storage.s3_client().get_object(Bucket=bucket, Key=key)
        data = response["Body"].read()
    except Exception as exc:
        if error_code(exc) in ("NoSuchKey", "404"):
            return None
        raise storage.storage_error(exc, "reading", uri) from exc
    return Versioned(data=data, token=str(response["ETag"]).strip('"'))


def _put_s3(uri: str, data: bytes, **condition: str) -> str | None:
    require_conditional_writes(uri)  # a server that ignores the condition would let every writer win
    bucket, _, key = uri[len(storage.S3) :].partition("/")
    for attempt in range(_CONFLICT_ATTEMPTS):
        try:
            response = storage.s3_client().put_object(Bucket=bucket, Key=key, Body=data, **condition)
            return str(response["ETag"]).strip('"')
        except Exception as exc:
            code = error_code(exc)
            if code not in _NOT_APPLIED:
                raise storage.storage_error(exc, "writing", uri) from exc
        # botocore retries a PUT whose answer was lost; the retry then fails its own
        # condition although the first attempt landed: our exact bytes mean it did
        current = _read_s3(uri)
        if current is not None and current.data == data:
            return current.token
        # 409: another conditional write to the key was in flight; S3 says to retry. Only worth it
        # while the condition still holds (the object is still what we compared with).
        still_holds = (
            (current is None)
            if "IfNoneMatch" in condition
            else (current is not None and f'"{current.token}"' == condition.get("IfMatch"))
        )
        if code not in _CONFLICT or not still_holds or attempt + 1 == _CONFLICT_ATTEMPTS:
            return None
        time.sleep(0.1 * (attempt + 1))
    return None
