"""Proof that an S3 endpoint honours conditional writes, asked once per endpoint and bucket in a process.

Every coordination rayline does in storage is a conditional PUT: leases,
version claims, alias moves and folder commits (``rayline.storage.conditional``),
and delta-rs's commits to a Delta table's ``_delta_log``. An S3-compatible
server that ignores ``If-None-Match`` and ``If-Match`` answers 200 to all of
them: every contender takes every lease, two registrations claim one version,
and concurrent nights lose commits, all without an error. So before the first
conditional write to a bucket, :func:`require_conditional_writes` creates a
probe key exclusively twice (the second must be refused), then writes it with
a stale ETag (refused too), and removes it. The answer is kept for the
process: a server does not change its mind between two writes.

Local disk needs no probe: its conditions are a hard link and a lock.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from rayline import storage
from rayline.config import get_settings
from rayline.errors import ConditionalWritesUnsupported

# S3's answers to a conditional write whose condition failed
_REFUSED = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
PROBE_PREFIX = ".rayline-conditional-probe-"  # hidden: listings of inputs and folders skip it

log = logging.getLogger(__name__)

_answers: dict[tuple[str | None, str], ConditionalWritesUnsupported | None] = {}
_lock = threading.Lock()


def require_conditional_writes(uri: str) -> None:
    """Refuse (``ConditionalWritesUnsupported``) a conditional write to ``uri`` on an endpoint that ignores them.

    Probes the endpoint and bucket of ``uri`` the first time (a few small
    requests beside ``uri``), then answers from memory. Local paths pass.
    """
    if not storage.is_s3(uri):
        return
    endpoint = get_settings().aws_endpoint_url
    bucket, key = storage.split_s3(uri)
    where = (endpoint, bucket)
    with _lock:  # one probe per bucket even when threads commit at once
        if where not in _answers:
            _answers[where] = _probe(endpoint, bucket, key.rpartition("/")[0])
        refusal = _answers[where]
    if refusal is not None:
        raise ConditionalWritesUnsupported(str(refusal))


def _probe(endpoint: str | None, bucket: str, folder: str) -> ConditionalWritesUnsupported | None:
    key = f"{folder}/{PROBE_PREFIX}{uuid.uuid4().hex}" if folder else f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    uri = f"{storage.S3}{bucket}/{key}"
    client = storage.s3_client()
    first = _put(client, bucket, key, b"first", uri, IfNoneMatch="*")
    lacks = []
    try:
        if _put(client, bucket, key, b"second", uri, IfNoneMatch="*") is not None:
            lacks.append("If-None-Match: * (a second exclusive create of one key landed)")
        _put(client, bucket, key, b"third", uri)
        if first is not None and _put(client, bucket, key, b"stale", uri, IfMatch=first) is not None:
            lacks.append("If-Match (a write with a stale ETag landed)")
    finally:
        _delete(client, bucket, key)
    if not lacks:
        return None
    return ConditionalWritesUnsupported(
        f"the S3 endpoint {endpoint or 'of the AWS SDK'} (bucket {bucket}) ignores {' and '.join(lacks)}. "
        "rayline's leases, version claims, alias moves and folder commits, and delta-rs's commits to the "
        "predictions tables, rely on conditional writes: without them concurrent runs overwrite each other "
        "silently. Nothing was written. Upgrade the server to one that honours If-None-Match and If-Match on "
        "PutObject (AWS S3 does), or use another storage; a locking provider for delta-rs "
        "(AWS_S3_LOCKING_PROVIDER=dynamodb) covers only the Delta tables' commits, not rayline's own"
    )


def _put(client: Any, bucket: str, key: str, data: bytes, uri: str, **condition: str) -> str | None:
    """The written object's ETag (quoted, as S3 sends it), or None when the condition refused the write."""
    try:
        return str(client.put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"])
    except Exception as exc:
        if error_code(exc) in _REFUSED:
            return None
        raise storage.storage_error(exc, "probing conditional writes with", uri) from exc


def _delete(client: Any, bucket: str, key: str) -> None:
    try:
        client.delete_object(Bucket=bucket, Key=key)
    except Exception as exc:  # never hide the probe's own answer; a hidden key of a few bytes is left
        log.warning("removing the conditional-write probe s3://%s/%s failed: %s", bucket, key, exc)


def error_code(exc: Exception) -> str:
    response: Any = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
