"""Content-addressed output folders that one run at a time fills, then commits with a manifest.

Two runs on one input map to one folder. Without a lease, the second would
remove the folder the first is filling, and the first's manifest (the commit)
could then name files that are gone — a folder reused forever after. So a run
takes a lease on the folder before it removes leftovers or writes, and proves
it still holds it (``ensure_held``) right before each of those.

The lease object sits beside the folder (``<folder>.lease``), never inside
it: removing a folder's leftovers must not remove the lease that guards them.

:func:`fill_once` is the whole sequence, shared by every stage that commits a
folder (ingest, preprocess): reuse what is committed, else take the lease,
clear, fill, and write the manifest last (:func:`rayline.manifests.commit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic

from pydantic import BaseModel, Field

from rayline import leases, manifests, storage
from rayline.manifests import Kind

LEASE_SUFFIX = ".lease"

log = logging.getLogger(__name__)


class LeasedOutput(BaseModel):
    """Config fields of a workload that fills a leased output folder."""

    holder: str | None = Field(
        None, description="Who takes the folder's lease (a flow run); None: this process, with a random tag."
    )
    # below the tasks' one-hour timeout, so a run that waits too long fails naming the holder instead
    lease_wait_s: float = Field(1800.0, ge=0, description="How long to wait for another run filling the folder.")
    lease_ttl_s: float = Field(120.0, gt=0, description="Lease expiry after the last renewal (renewed every ttl/3).")


@dataclass(frozen=True)
class Committed(Generic[Kind]):
    """A committed folder's manifest, and whether this run reused it or committed it."""

    manifest: Kind
    uri: str  # the manifest's
    cached: bool
    waited_s: float = 0.0  # how long this run waited for another run filling the same folder


def lease_uri(folder: str) -> str:
    """Where the lease on ``folder`` lives: beside it, so removing the folder leaves it."""
    return storage.normalize(folder) + LEASE_SUFFIX


@contextmanager
def leased(folder: str, cfg: LeasedOutput, what: str) -> Iterator[leases.HeldLease]:
    """Hold the lease on ``folder`` for the block; LeaseBusy naming the holder after ``cfg.lease_wait_s``."""
    holder = cfg.holder or leases.run_holder()
    with leases.held(lease_uri(folder), holder, ttl_s=cfg.lease_ttl_s, wait_s=cfg.lease_wait_s, describe=what) as lease:
        yield lease


def clear(folder: str, lease: leases.HeldLease) -> None:
    """Remove the leftovers of an uncommitted run, only while the lease is still this run's."""
    lease.ensure_held()
    storage.remove_tree(folder)


def note_reuse(what: str, lease: leases.HeldLease) -> None:
    """Say why a run that waited for the lease wrote nothing: the run it waited for committed."""
    log.info("another run held %s; waited %.1f s, found it committed", what, lease.waited_s)


def fill_once(
    folder: str,
    cfg: LeasedOutput,
    what: str,
    kind: type[Kind],
    *,
    reusable: Callable[[Kind], bool],
    force: bool,
    fill: Callable[[leases.HeldLease], Kind],
) -> Committed[Kind]:
    """``folder``'s committed manifest, or else the one ``fill`` returns, committed after its files.

    A committed folder is reused without the lease when ``reusable`` accepts
    its manifest: only a forced run removes one. Otherwise the run takes the
    lease, looks again (the run it waited for may have committed meanwhile),
    and only then clears leftovers of an uncommitted run, lets ``fill`` write
    the files (it returns their manifest) and commits the manifest last.
    """
    uri = manifests.manifest_uri(folder)

    def committed() -> Kind | None:
        if force:
            return None
        found = manifests.read_committed(folder, kind)
        return found if found is not None and reusable(found) else None

    if (reused := committed()) is not None:
        return Committed(reused, uri, cached=True)
    with leased(folder, cfg, what) as lease:
        if (reused := committed()) is not None:
            note_reuse(what, lease)
            return Committed(reused, uri, cached=True, waited_s=lease.waited_s)
        clear(folder, lease)
        manifest = fill(lease)
        manifests.commit(folder, manifest, lease)
        return Committed(manifest, uri, cached=False, waited_s=lease.waited_s)
