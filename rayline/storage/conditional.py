"""Conditional writes: create-if-absent and compare-and-swap on one small object, on every store.

The one implementation behind the registry's version claims, alias moves, leases, folder commits and the
execution plans' claims. Every object written here has a *token* that changes with its content: its version
in the store (``rayline.storage.backends``). A cloud store checks the condition itself and refuses the loser;
a server that ignores the conditions would let every writer win, so the first conditional write to a bucket
probes it (``rayline.storage.conditional_probe``).

Tokens are derived from content on local disk, so a swap must write bytes that differ from the ones it
replaces (leases carry a generation number that grows with each write). The bytes should also name their
writer: after a retried PUT, finding exactly one's own bytes is how a write that landed is recognised.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rayline import storage
from rayline.storage.conditional_probe import require_conditional_writes

# A refused write whose condition still held was refused for another writer in flight (S3's 409
# ConditionalRequestConflict): the store says to try again.
_CONFLICT_ATTEMPTS = 3


@dataclass(frozen=True)
class Versioned:
    """An object's bytes and the token of exactly those bytes."""

    data: bytes
    token: str


def create_exclusive(uri: str, data: bytes) -> str | None:
    """Write ``uri`` only if it does not exist: its token, or None if it existed already."""
    uri = storage.normalize(uri)
    store = _checked_store(uri)
    return _settle(uri, data, lambda: store.put_if_absent(uri, data), lambda current: current is None)


def read_versioned(uri: str) -> Versioned | None:
    """The object's bytes and token; None when there is no object."""
    uri = storage.normalize(uri)
    with storage.storage_errors("reading", uri):
        found = storage.store(uri).get(uri)
    return None if found is None else Versioned(found.data, found.version)


def replace_if_match(uri: str, data: bytes, token: str) -> str | None:
    """Replace ``uri`` with ``data`` only if its token is still ``token``: the new token, or None."""
    uri = storage.normalize(uri)
    store = _checked_store(uri)
    return _settle(
        uri,
        data,
        lambda: store.put_if_match(uri, data, token),
        lambda current: current is not None and current.token == token,
    )


def _checked_store(uri: str) -> storage.ObjectStore:
    if storage.is_remote(uri):
        require_conditional_writes(uri)  # a server that ignores the condition would let every writer win
    return storage.store(uri)


def _settle(
    uri: str, data: bytes, write: Callable[[], str | None], still_holds: Callable[[Versioned | None], bool]
) -> str | None:
    """Run a conditional ``write``: its token, or None when another writer's object stands. A refusal is looked
    at again: the client retries a write whose answer was lost, and the retry then fails its own condition
    although the first attempt landed (our exact bytes mean it did); and a refusal while the condition still
    holds was a conflict with a write in flight, worth a retry."""
    for attempt in range(_CONFLICT_ATTEMPTS):
        with storage.storage_errors("writing", uri):
            token = write()
        if token is not None:
            return token
        current = read_versioned(uri)
        if current is not None and current.data == data:
            return current.token
        if not still_holds(current) or attempt + 1 == _CONFLICT_ATTEMPTS:
            return None
        time.sleep(0.1 * (attempt + 1))
    return None
