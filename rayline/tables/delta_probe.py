"""Proof that delta-rs can commit to a Delta table where a night is about to write its tables.

delta-rs talks to cloud stores through its own client (``object_store``), not through rayline's: a store
that serves rayline's requests but not delta-rs's would let a night predict every input and then fail at its
commit. So before a night's first work on a store, :func:`require_delta_writes` asks the store whether it
knows delta-rs cannot write there (a GCS emulator), then commits a one-row table under ``<root>/_staging``,
reads it back, and removes it; the answer is kept for the process, per bucket and endpoint.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from rayline import storage
from rayline.errors import DeltaWritesUnsupported, TransientStorageError, is_transient

log = logging.getLogger(__name__)

_TRANSIENT_ATTEMPTS = 3
_answers: dict[tuple[str, str | None], DeltaWritesUnsupported | None] = {}
_lock = threading.Lock()


def require_delta_writes(tables_root: str) -> None:
    """Refuse (``DeltaWritesUnsupported``) a night whose tables under ``tables_root`` delta-rs cannot write."""
    root = storage.normalize(tables_root)
    if not storage.is_remote(root):
        return
    scheme, _, rest = root.partition("://")
    where = (f"{scheme}://{rest.partition('/')[0]}", storage.endpoint_of(root))
    with _lock:
        if where not in _answers:
            _answers[where] = _probe(root)
        refusal = _answers[where]
    if refusal is not None:
        raise refusal


def _probe(root: str) -> DeltaWritesUnsupported | None:
    """The store's own refusal, or the probe's answer. A transient failure (the store's trouble of the moment,
    not what it can do) is tried again, then raised as :class:`TransientStorageError`, never kept."""
    refusal = storage.delta_write_refusal(root)
    if refusal is not None:
        return DeltaWritesUnsupported(f"{refusal}. The night's predictions are Delta tables, so nothing was predicted.")
    for attempt in range(_TRANSIENT_ATTEMPTS):
        try:
            return _probe_once(root)
        except TransientStorageError:
            if attempt + 1 == _TRANSIENT_ATTEMPTS:
                raise
            time.sleep(0.5 * (attempt + 1))
    return None


def _probe_once(root: str) -> DeltaWritesUnsupported | None:
    probe = storage.join(root, "_staging", f"delta-probe-{uuid.uuid4().hex}")
    options = storage.delta_options(probe)
    try:
        write_deltalake(probe, pa.table({"probe": [1]}), storage_options=options)
        rows = DeltaTable(probe, storage_options=options).to_pyarrow_table().num_rows
    except Exception as exc:  # delta-rs raises its own, pyarrow's and OSError: is_transient sorts them
        if is_transient(exc):
            raise TransientStorageError(f"probing Delta writes at {probe}: {type(exc).__name__}: {exc}") from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        endpoint = storage.endpoint_of(root) or "the cloud's own"
        return DeltaWritesUnsupported(
            f"delta-rs could not write a Delta table at {root} (endpoint {endpoint}): {type(exc).__name__}: "
            f"{first[:300]}. The night's predictions are Delta tables, so nothing was predicted. Check the "
            "credentials delta-rs reads and the endpoint (docs/storage.md)."
        )
    finally:
        try:
            storage.remove_tree(probe)
        except Exception as exc:  # never hide the probe's own answer; a hidden folder of a few bytes is left
            log.warning("removing the Delta write probe %s failed: %s", probe, exc)
    return None if rows == 1 else DeltaWritesUnsupported(f"delta-rs wrote a table at {probe} but read {rows} rows")
