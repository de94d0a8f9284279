"""Content-addressed output folders that one run at a time fills, then commits with a manifest.

Two runs on one input map to one folder, so a run takes a lease on the folder (``<folder>.lease``, beside
it: removing what is in the folder must never remove the lease that guards it) before it writes there.

What a commit removes (:func:`remove_superseded`), only after its switch: generations of earlier lease
holders (their fence is lower: they lost the lease, so their commit can no longer land), except the
generation the switch replaced, which its readers may still be inside; the next commit removes it. A
generation of a later holder (a higher fence) is never removed: a run paused in its clean-up must not remove
the files of the run that took over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

from pydantic import BaseModel, Field

from rayline import storage
from rayline.config import lease_ttl
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


def remove_superseded(folder: str, keep: set[str | None], lease: leases.HeldLease) -> list[str]:
    """Remove what earlier lease holders left in ``folder``, but its manifest and the generations ``keep``
    (None: files in the folder itself); leftovers of a later holder and hidden names (the manifest's lock file
    on local disk) stay. Returns what it removed."""
    fence = lease.fencing_token().generation
    removed = []
    for name in storage.list_names(folder):
        generation = manifests.generation_of(name)
        if name.startswith(".") or any(manifests.belongs_to(name, kept) for kept in keep):
            continue
        if generation is not None and manifests.generation_fence(generation) > fence:
            continue  # a later holder's, being filled now
        lease.ensure_held()
        storage.remove_tree(storage.join(folder, name))
        removed.append(name)
    return removed


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

    The whole sequence of every stage that commits a folder: a committed folder is reused without the lease
    when ``reusable`` accepts its manifest; else ``fill`` writes a new generation under the lease, whose
    manifest is switched to by :func:`rayline.storage.manifests.commit` (``LeaseLost`` when another run
    committed since). A forced run that fails leaves the old output committed as it was.
    """
    uri = manifests.manifest_uri(folder)

    def committed() -> Kind | None:
        if force:
            return None
        found = manifests.read_committed(folder, kind)
        return found if found is not None and reusable(found) else None

    if (reused := committed()) is not None:
        return Committed(reused, uri, cached=True)
    holder = cfg.holder or leases.run_holder()  # LeaseBusy, naming the holder, after cfg.lease_wait_s
    with leases.held(lease_uri(folder), holder, ttl_s=cfg.lease_ttl_s, wait_s=cfg.lease_wait_s, describe=what) as lease:
        if (reused := committed()) is not None:
            log.info("another run held %s; waited %.1f s, found it committed", what, lease.waited_s)
            return Committed(reused, uri, cached=True, waited_s=lease.waited_s)
        current, token = manifests.read_for_switch(folder, kind, malformed_ok=force)
        if current is None and token is not None:
            log.warning("%s has a malformed manifest: the forced run replaces it", folder)
        generation = manifests.new_generation(lease.fencing_token().generation)
        manifest = fill(lease, manifests.generation_folder(folder, generation))
        manifest = manifest.model_copy(update={"generation": generation})
        manifests.commit(folder, manifest, lease, replaces=token)  # the switch: readers now find the new generation
        replaced = {current.generation} if current is not None else set()
        remove_superseded(folder, {generation, *replaced}, lease)
        return Committed(manifest, uri, cached=False, waited_s=lease.waited_s)
