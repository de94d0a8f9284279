"""Proof that an object store honours conditional writes, asked once per store and bucket in a process.

Every coordination rayline does in storage is a conditional write (``rayline.storage.conditional``), and so
is delta-rs's commit to a Delta table's ``_delta_log``. A server that ignores the conditions answers 200 to
all of them: every contender takes every lease, and concurrent nights lose commits, all without an error. So
before the first conditional write to a bucket, :func:`require_conditional_writes` creates a probe key
exclusively twice (the second must be refused), then writes it with a stale version (refused too), and
removes it. The answer is kept for the process. Local disk needs no probe: its conditions are a hard link
and a lock.
"""

from __future__ import annotations

import logging
import threading
import uuid

from rayline import storage
from rayline.errors import ConditionalWritesUnsupported

PROBE_PREFIX = ".rayline-conditional-probe-"  # hidden: listings of inputs and folders skip it

log = logging.getLogger(__name__)

_answers: dict[tuple[str, str | None], ConditionalWritesUnsupported | None] = {}
_lock = threading.Lock()

# What each store calls its conditions, for the refusal's message
_CONDITIONS = {
    "s3": ("If-None-Match: * on PutObject", "If-Match on PutObject"),
    "gs": ("ifGenerationMatch=0 on an upload", "ifGenerationMatch=<generation> on an upload"),
    "az": ("If-None-Match: * on Put Blob", "If-Match on Put Blob"),
}


def require_conditional_writes(uri: str) -> None:
    """Refuse (``ConditionalWritesUnsupported``) a conditional write to ``uri`` on a store that ignores them;
    the first time for its store and bucket, a few small requests beside ``uri`` find out."""
    uri = storage.normalize(uri)
    if not storage.is_remote(uri):
        return
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    where = (f"{scheme}://{bucket}", storage.endpoint_of(uri))
    with _lock:  # one probe per bucket even when threads commit at once
        if where not in _answers:
            _answers[where] = _probe(uri, scheme, bucket, key.rpartition("/")[0])
        refusal = _answers[where]
    if refusal is not None:
        raise ConditionalWritesUnsupported(str(refusal))


def _probe(uri: str, scheme: str, bucket: str, folder: str) -> ConditionalWritesUnsupported | None:
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    probe = f"{scheme}://{bucket}/{folder}/{name}" if folder else f"{scheme}://{bucket}/{name}"
    store = storage.store(probe)
    create, swap = _CONDITIONS[scheme]
    lacks = []
    try:
        with storage.storage_errors("probing conditional writes with", probe):
            first = store.put_if_absent(probe, b"first")
            if store.put_if_absent(probe, b"second") is not None:
                lacks.append(f"{create} (a second exclusive create of one key landed)")
            store.put(probe, b"third")
            if first is not None and store.put_if_match(probe, b"stale", first) is not None:
                lacks.append(f"{swap} (a write with a stale version landed)")
    finally:
        try:
            store.delete(probe)
        except Exception as exc:  # never hide the probe's own answer; a hidden key of a few bytes is left
            log.warning("removing the conditional-write probe %s failed: %s", probe, exc)
    if not lacks:
        return None
    endpoint = storage.endpoint_of(uri) or "of the cloud's SDK"
    return ConditionalWritesUnsupported(
        f"the {scheme.upper()} endpoint {endpoint} (bucket {bucket}) ignores {' and '.join(lacks)}. "
        "rayline's leases, version claims, alias moves and folder commits, and delta-rs's commits to the "
        "predictions tables, rely on conditional writes: without them concurrent runs overwrite each other "
        "silently. Nothing was written. Upgrade the server to one that honours them (AWS S3, GCS and Azure Blob "
        "do), or use another storage; a locking provider for delta-rs (AWS_S3_LOCKING_PROVIDER=dynamodb) covers "
        "only the Delta tables' commits, not rayline's own"
    )
