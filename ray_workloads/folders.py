"""Content-addressed output folders that one run at a time fills.

Two runs on one input map to one folder. Without a lease, the second would
remove the folder the first is filling, and the first's manifest (the commit)
could then name files that are gone — a folder reused forever after. So a run
takes a lease on the folder before it removes leftovers or writes, and proves
it still holds it (``ensure_held``) right before each of those.

The lease object sits beside the folder (``<folder>.lease``), never inside
it: removing a folder's leftovers must not remove the lease that guards them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from pydantic import BaseModel, Field

from rayline import leases, storage

LEASE_SUFFIX = ".lease"

Result = TypeVar("Result", bound=BaseModel)

log = logging.getLogger(__name__)


class LeasedOutput(BaseModel):
    """Config fields of a workload that fills a leased output folder."""

    holder: str | None = Field(
        None, description="Who takes the folder's lease (a flow run); None: this process, with a random tag."
    )
    # below the tasks' one-hour timeout, so a run that waits too long fails naming the holder instead
    lease_wait_s: float = Field(1800.0, ge=0, description="How long to wait for another run filling the folder.")
    lease_ttl_s: float = Field(120.0, gt=0, description="Lease expiry after the last renewal (renewed every ttl/3).")


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


def reuse_or_fill(
    folder: str,
    cfg: LeasedOutput,
    what: str,
    committed: Callable[[], Result | None],
    fill: Callable[[leases.HeldLease], Result],
) -> Result:
    """What ``folder`` holds committed, or else what ``fill`` commits into it, filled by one run at a time.

    A committed folder is reused without the lease: only a forced run removes
    one (``committed`` answers None when forced). Otherwise the run takes the
    lease, looks again (the run it waited for may have committed meanwhile),
    and only then clears leftovers of an uncommitted run and fills it.
    The result's ``waited_s`` says how long it waited for the lease.
    """
    if (reused := committed()) is not None:
        return reused
    with leased(folder, cfg, what) as lease:
        if (reused := committed()) is not None:
            note_reuse(what, lease)
            return reused.model_copy(update={"waited_s": lease.waited_s})
        clear(folder, lease)
        return fill(lease).model_copy(update={"waited_s": lease.waited_s})
