"""Reading many small objects: concurrent GETs, and rounds of re-reads for transient failures.

A transient failure (throttling, 5xx, a reset, a body cut short) is retried by the store's client
(``RAYLINE_STORAGE_MAX_ATTEMPTS``), then by this loop's rounds; one that outlasts them fails the stage as
transient, never an object's error row. A read refused for want of permission fails the stage too: a policy
is the run's fault, not the object's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rayline.config import get_settings
from rayline.errors import (
    ObjectChangedError,
    StorageAccessDenied,
    TransientStorageError,
    is_access_denied,
    is_transient,
)
from rayline.storage.backends import ObjectStore, scheme_of, store_for
from rayline.storage.backends.local import read_as_listed
from rayline.storage.uris import is_remote, normalize


@dataclass(frozen=True)
class Fetched:
    """One object's bytes and the version actually read (its ETag or generation), or why it failed."""

    data: bytes | None
    etag: str | None = None
    error: BaseException | None = None


def as_listed(fetched: Fetched, listed_etag: str) -> Fetched:
    """``fetched``, or an :class:`ObjectChangedError` when it read another version than the listing's (every
    read names its version, a local file's too, so a read without one is no proof of the listed version)."""
    if fetched.error is not None or fetched.etag == listed_etag:
        return fetched
    changed = ObjectChangedError(f"etag changed from {listed_etag} (listed) to {fetched.etag} (read)")
    return Fetched(data=None, etag=fetched.etag, error=changed)


def _fetch_remote(uri: str, store: ObjectStore) -> Fetched:
    try:
        found = store.get(uri)
    except Exception as exc:  # whatever the client raised is this object's error; the caller sorts out the run's
        return Fetched(data=None, error=exc)
    if found is None:
        return Fetched(data=None, error=FileNotFoundError(f"no object at {uri}"))
    return Fetched(data=found.data, etag=found.version)


def _fetch_local(uri: str) -> Fetched:
    """The file's bytes with the version a listing gives it (size and modification time, from the handle read);
    a file written in place while it was read has no one version: an :class:`ObjectChangedError`."""
    path = uri if uri.startswith("/") else normalize(uri)  # listed URIs are absolute already
    try:
        data, before, after = read_as_listed(path)
    except Exception as exc:  # whatever the read raised is this object's error; the caller sorts out the run's
        return Fetched(data=None, error=exc)
    if before != after:
        changed = ObjectChangedError(f"{path} was written while read: version {before} before, {after} after")
        return Fetched(data=None, etag=after, error=changed)
    return Fetched(data=data, etag=before)


def _fetch_pass(uris: list[str], concurrency: int) -> list[Fetched]:
    """One read of each object, in order; failures are returned, not raised. Reads from a cloud store overlap
    on a thread pool: per-request latency dominates with many small objects. Local files are read one after
    another: from the page cache a read costs less than handing it to a thread pool would (bench/README.md)."""
    if not any(is_remote(u) for u in uris):
        return [_fetch_local(u) for u in uris]
    workers = max(1, min(concurrency, len(uris)))
    stores = {scheme_of(u): store_for(u) for u in uris if is_remote(u)}  # one client per store, for the whole pass

    def fetch(uri: str) -> Fetched:
        return _fetch_remote(uri, stores[scheme_of(uri)]) if is_remote(uri) else _fetch_local(uri)

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fetch, uris))


def fetch_retry_delays() -> list[float]:
    """Waits before each round of :func:`fetch_many`'s re-fetches: doubling from the setting, jittered ±50 %
    to spread the rounds of tasks throttled together."""
    settings = get_settings()
    base = settings.fetch_retry_delay_s
    return [base * 2**i * random.uniform(0.5, 1.5) for i in range(settings.fetch_retries)]


def _failing(results: list[Fetched], kind: Callable[[BaseException], bool]) -> list[int]:
    """The places of the reads whose error is of ``kind`` (transient, refused for permission)."""
    return [i for i, f in enumerate(results) if f.error is not None and kind(f.error)]


def _raise_for(uris: list[str], results: list[Fetched], failing: list[int], error: type[Exception], what: str) -> None:
    """Raise ``error``, saying how many objects ``what`` and naming the first, when any reads are ``failing``."""
    if failing:
        first = results[failing[0]].error
        raise error(
            f"{len(failing)} of {len(uris)} objects {what}, e.g. {uris[failing[0]]}: {type(first).__name__}: {first}"
        ) from first


def retry_transient(
    uris: list[str],
    fetch: Callable[[list[str]], list[Fetched]],
    delays: list[float],
    sleep: Callable[[float], None] = time.sleep,
) -> list[Fetched]:
    """``fetch(uris)``, then fetch again, after each delay, the objects whose read failed transiently. Such a
    failure (``errors.is_transient``) is not the object's fault, so it must never become its error row: objects
    still failing so after the last round fail the whole call with :class:`TransientStorageError`, which the
    stage's task retry takes up. Other failures are returned as they are."""
    results = fetch(uris)
    for delay in delays:
        pending = _failing(results, is_transient)
        if not pending:
            break
        sleep(delay)
        for i, fetched in zip(pending, fetch([uris[i] for i in pending]), strict=True):
            results[i] = fetched
    rounds = (
        f"still failed transiently after {len(delays)} more rounds of reads (each with the store client's own retries)"
    )
    _raise_for(uris, results, _failing(results, is_transient), TransientStorageError, rounds)
    return results


def refuse_denied(uris: list[str], results: list[Fetched]) -> list[Fetched]:
    """``results``, unless a read was refused for want of permission: then :class:`StorageAccessDenied`. One
    refusal is enough: an AccessDenied (403, ``PermissionError``) says what the caller may do, not what the
    object is, and rows of such objects committed or cached would outlive the fix of the policy."""
    why = "refused for want of permission (a bucket policy, role or credentials of this run, not the objects)"
    _raise_for(uris, results, _failing(results, is_access_denied), StorageAccessDenied, why)
    return results


def fetch_checked(
    uris: list[str],
    fetch: Callable[[list[str]], list[Fetched]],
    delays: list[float],
    sleep: Callable[[float], None] = time.sleep,
) -> list[Fetched]:
    """:func:`retry_transient`, then :func:`refuse_denied`: what is left are the objects' own errors."""
    return refuse_denied(uris, retry_transient(uris, fetch, delays, sleep))


def fetch_many(uris: list[str], concurrency: int) -> list[Fetched]:
    """Read many small objects, in order, ``concurrency`` at a time: objects that cannot be read for good
    (missing, replaced) come back with their error; the rest as :func:`fetch_checked` says."""
    return fetch_checked(uris, lambda batch: _fetch_pass(batch, concurrency), fetch_retry_delays())
