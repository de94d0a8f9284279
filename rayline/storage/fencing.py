"""Fencing tokens: what a lease holder shows whoever it changes, so a holder that lost its lease is refused.

A lease (``rayline.storage.leases``) is proved in storage before each commit, but a holder paused between
that proof and its change (SIGSTOP, a VM freeze, a long GC) acts after another run took its lease over. So a
holder's changes to something outside storage carry its :class:`Fence`, the generation of the write that took
the lease, higher for every later holder. The receiver keeps the highest it has seen per lease (:func:`admit`)
and refuses lower ones with ``StaleFence``.

No imports beyond the errors: receivers (a Ray actor) load this module alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayline.errors import StaleFence


@dataclass(frozen=True)
class Fence:
    """A lease holder's fencing token: the lease (its URI), the generation that took it, and who holds it."""

    lease: str
    generation: int
    holder: str


def admit(seen: dict[str, Fence], fence: Fence | None, what: str) -> bool:
    """Refuse ``what`` (``StaleFence``) if ``fence`` is older than the newest fence of its lease in ``seen``;
    record it there when it is the newest, and say whether ``seen`` changed. A change without a fence (an
    operator's, by hand) is let through: only lease holders are fenced."""
    if fence is None:
        return False
    newest = seen.get(fence.lease)
    if newest is not None and fence.generation < newest.generation:
        raise StaleFence(
            f"{what} refused: {fence.holder} holds generation {fence.generation} of lease {fence.lease}, but "
            f"{newest.holder} has since acted with generation {newest.generation} (it took the lease over while "
            f"{fence.holder} was paused or cut off past the lease's ttl)"
        )
    if newest is not None and fence.generation == newest.generation:
        return False
    seen[fence.lease] = fence
    return True
