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
clear, fill, and write the manifest last (:func:`rayline.storage.manifests.commit`).
A run over a committed folder writes a new generation and switches to it at
the commit (:mod:`rayline.storage.manifests`): readers never see a folder emptied.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic

from pydantic import BaseModel, Field

from rayline import storage
from rayline.config import lease_ttl
from rayline.errors import InputDataError
from rayline.storage import leases, manifests
from rayline.storage.manifests import Kind

LEASE_SUFFIX = ".lease"

log = logging.getLogger(__name__)


class LeasedOutput(BaseModel):
    """Config fields of a workload that fills a leased output folder."""

    holder: str | None = Field(
        None, description="Who takes the folder's lease (a flow run); None: this process, with a random tag."
    )
    # below the tasks' one-hour timeout, so a run that waits too long fails naming the holder instead
    lease_wait_s: float = Field(1800.0, ge=0, description="How long to wait for another run filling the folder.")
    lease_ttl_s: float = Field(
        default_factory=lambda: lease_ttl(120.0),
        gt=0,
        description="Lease expiry after the last renewal (renewed every ttl/3); default RAYLINE_LEASE_TTL_S or 120 s.",
    )


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


def clear_except(folder: str, generation: str | None, lease: leases.HeldLease) -> None:
    """Remove everything in ``folder`` but its manifest and its generation ``generation``'s files.

    Before a new generation is written: the leftovers of runs that never
    committed (the committed generation stays whole for its readers). After
    the switch: the superseded generation too.
    """
    for name in storage.list_names(folder):
        if not manifests.belongs_to(name, generation):
            lease.ensure_held()
            storage.remove_tree(storage.join(folder, name))


def new_generation() -> str:
    return uuid.uuid4().hex[:12]


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
    fill: Callable[[leases.HeldLease, str], Kind],
) -> Committed[Kind]:
    """``folder``'s committed manifest, or else the one ``fill`` returns, committed after its files.

    A committed folder is reused without the lease when ``reusable`` accepts
    its manifest. Otherwise the run takes the lease, looks again (the run it
    waited for may have committed meanwhile), clears what no committed
    manifest names, and lets ``fill`` write the files into the folder it is
    given (it returns their manifest); the manifest is committed last.

    Over a committed folder (a forced run, or a manifest no longer reusable)
    ``fill`` writes a new generation beside the committed one, which stays
    whole for its readers; the new manifest replaces the old in one atomic
    write, and only then is the old generation removed. A forced run that
    fails leaves the old output committed as it was.
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
        current = _committed_or_none(folder, kind, force)
        if current is None:
            clear(folder, lease)
            generation = None  # nothing committed: the files go in the folder itself
        else:
            clear_except(folder, current.generation, lease)
            generation = new_generation()
        manifest = fill(lease, manifests.generation_folder(folder, generation))
        manifest = manifest.model_copy(update={"generation": generation})
        manifests.commit(folder, manifest, lease)  # the switch: readers now find the new generation
        if current is not None:
            clear_except(folder, generation, lease)
        return Committed(manifest, uri, cached=False, waited_s=lease.waited_s)


def _committed_or_none(folder: str, kind: type[Kind], force: bool) -> Kind | None:
    """The folder's committed manifest; for a forced run, a malformed one counts as none (it is rewritten)."""
    try:
        return manifests.read_committed(folder, kind)
    except InputDataError:
        if not force:
            raise
        log.warning("%s has a malformed manifest: the forced run rewrites the folder", folder)
        return None
