"""Who holds a night: its lease (one live run predicts a night) and each holder's own listing folder.

A run takes the night's lease (:func:`held_night`) before it lists or predicts, lists into a folder of
its lease generation, and once it commits removes the folders its predecessors left.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

from rayline import storage
from rayline.errors import StorageError
from rayline.storage import leases
from rayline.storage.folders import LeasedOutput
from rayline.storage.layout import staging_uri
from rayline.tables.delta_tables import Night

log = logging.getLogger(__name__)


def listing_staging_uri(root: str, night: Night, fence: int, holding: str) -> str:
    """``<root>/_staging/nights/<model>/dt=<day>.listing-<fence>-<holding>``: the listing of the holder of
    the lease's generation ``fence`` (``holding`` tells apart two holders of one generation: a lease removed
    by hand restarts them). A folder of its own: a holder that lost the lease while paused never touches
    the listing of the run that took the night over."""
    return staging_uri(root, "nights", night.model_name, f"dt={night.dt}.listing-{fence}-{holding}")


def night_listings(root: str, night: Night) -> dict[str, int]:
    """The listing folders of the night's holders, each with its lease generation (leftovers of holders that
    died, and the live holder's)."""
    folder = staging_uri(root, "nights", night.model_name)
    pattern = re.compile(rf"^dt={re.escape(night.dt)}\.listing-(\d+)-[0-9a-z]+$")
    found = ((name, pattern.match(name)) for name in storage.list_folders(folder))
    return {storage.join(folder, name): int(match.group(1)) for name, match in found if match}


def remove_earlier_listings(root: str, night: Night, fence: int, own: str) -> None:
    """Remove the listings of the night's earlier holders (generation up to ``fence``, ``own`` excepted),
    whose work is void. Called once the night is committed, so a storage error is only logged: the next
    holder removes what is left."""
    try:
        for uri, generation in night_listings(root, night).items():
            if generation <= fence and uri != own:
                storage.remove_tree(uri)
    except StorageError as exc:
        log.warning("listings of earlier runs of %s %s stay for the next run: %s", night.model_name, night.dt, exc)


def night_lease_uri(root: str, night: Night) -> str:
    """``<root>/_staging/nights/<model>/dt=<day>.lease``: the lease of one night."""
    return staging_uri(root, "nights", night.model_name, f"dt={night.dt}.lease")


@contextmanager
def held_night(root: str, night: Night, cfg: LeasedOutput) -> Iterator[leases.HeldLease]:
    """The night's lease: one live run predicts a night; the others wait, then find it committed or take over
    (a dead holder's lease expires after ``lease_ttl_s``; the next run reuses its blocks: same night key)."""
    holder = cfg.holder or leases.run_holder()
    describe = f"the night {night.model_name} {night.dt}"
    uri = night_lease_uri(root, night)
    with leases.held(uri, holder, ttl_s=cfg.lease_ttl_s, wait_s=cfg.lease_wait_s, describe=describe) as lease:
        yield lease
