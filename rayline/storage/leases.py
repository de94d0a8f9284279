"""Leases in storage: one run at a time works on one output.

A lease is a small JSON object (holder, what it guards, when it expires, a generation) that runs take
before working on an output and renew while they work. Every write is conditional
(``rayline.storage.conditional``):

* take: create-if-absent; if the object exists but is expired, released or already this holder's, a
  compare-and-swap on exactly the content read: of several runs taking over one expired lease, one wins;
* renew: a compare-and-swap on the token of this run's last write; ``LeaseLost`` once anyone else wrote it;
* release: a compare-and-swap to a *released* state; a lease someone else took meanwhile is left alone.

Nothing here deletes a lease, so there is no remove-then-create window in which two runs could both think
they hold it. Each write raises the generation, so no two writes have the same bytes (tokens are content
hashes or ETags), and each lease keeps the generation of the write that took it (``fence``): a later
acquisition's is higher than every write before it, the fencing token a holder shows what it changes outside
storage (``rayline.storage.fencing``). Removing a lease by hand restarts its generations: receivers that saw
the old ones refuse the new holder until they forget them.

Times are wall-clock seconds written by one host and read by others: hosts sharing a storage need clocks
that agree to well within a lease's ttl.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from rayline import storage
from rayline.errors import ConfigError, LeaseBusy, LeaseLost, StorageError
from rayline.storage import conditional
from rayline.storage.fencing import Fence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """One write of a lease as its writer made it; ``token`` identifies that write."""

    uri: str
    holder: str
    guards: str  # what the lease serialises, for messages ("the rollout of digits")
    acquired_at: float
    expires_at: float
    ttl_s: float
    generation: int
    token: str
    released: bool = False
    fence: int = 0  # the generation of the write that took the lease; renewals keep it

    def fencing_token(self) -> Fence:
        """What this holder shows the things it changes: newer than any earlier holder's."""
        return Fence(lease=self.uri, generation=self.fence, holder=self.holder)

    def expires_in(self, now: float | None = None) -> float:
        return self.expires_at - (time.time() if now is None else now)

    def is_live(self, now: float | None = None) -> bool:
        return not self.released and self.expires_in(now) > 0


def run_holder(run: str | None = None) -> str:
    """A holder naming this run: ``run`` (a flow run's name and id) on this host and process. Holders must
    differ between runs: a lease already held by ``holder`` is taken again by it."""
    label = run or f"process {uuid.uuid4().hex[:8]}"
    return f"{label} on {socket.gethostname()} pid {os.getpid()}"


def read(uri: str) -> Lease | None:
    """The lease as last written, or None if none was ever taken."""
    uri = storage.normalize(uri)
    current = conditional.read_versioned(uri)
    return None if current is None else _parse(uri, current)


def try_acquire(uri: str, holder: str, ttl_s: float, *, describe: str = "") -> Lease | None:
    """Take the lease for ``ttl_s`` seconds: the lease, or None while another run holds it."""
    uri = storage.normalize(uri)
    now = time.time()
    fresh = Lease(uri, holder, describe or uri, now, now + ttl_s, ttl_s, generation=1, token="", fence=1)
    token = conditional.create_exclusive(uri, _body(fresh))
    if token is not None:
        return replace(fresh, token=token)
    current = read(uri)
    if current is None or (current.is_live(now) and current.holder != holder):
        return None  # held (or removed by hand just now: the next try creates it)
    taken = current.generation + 1
    return _swap(current, replace(fresh, generation=taken, fence=taken))


def renew(lease: Lease, ttl_s: float | None = None) -> Lease:
    """Extend ``lease`` by its ttl (or ``ttl_s``) from now; LeaseLost if anyone else wrote it since."""
    ttl = lease.ttl_s if ttl_s is None else ttl_s
    new = replace(lease, expires_at=time.time() + ttl, ttl_s=ttl, generation=lease.generation + 1)
    renewed = _swap(lease, new)
    if renewed is None:
        landed = _own_renewal_that_landed(lease)
        renewed = _swap(landed, replace(new, generation=landed.generation + 1)) if landed else None
    if renewed is None:
        raise _lost(lease)
    return renewed


def _own_renewal_that_landed(lease: Lease) -> Lease | None:
    """The stored lease, if it is this very acquisition renewed once more than ``lease`` knows: a renewal
    whose write landed but whose answer was lost, so the holder kept the older token."""
    current = read(lease.uri)
    ours = (
        current is not None
        and not current.released
        and current.holder == lease.holder
        and current.acquired_at == lease.acquired_at
        and current.generation == lease.generation + 1
    )
    return current if ours else None


def release(lease: Lease) -> bool:
    """Give the lease up if it is still this write of ours; False (and nothing changed) otherwise."""
    gone = replace(lease, expires_at=time.time(), generation=lease.generation + 1, released=True)
    return _swap(lease, gone) is not None


class HeldLease:
    """A lease held for a ``with`` block: renewed from a daemon thread, proved before commits."""

    def __init__(self, lease: Lease, *, waited_s: float, renew_every_s: float) -> None:
        self.waited_s = waited_s
        self._lease = lease
        self._lost: LeaseLost | None = None
        self._on_lost: list[Callable[[LeaseLost], None]] = []
        self._told = False  # whether the callbacks were called: once, by whichever thread found the loss
        # the renewer and ensure_held() swap from the same token: one at a time, or one would lose to the other
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._renew_loop, args=(renew_every_s,), name=f"lease-renewer {lease.guards}", daemon=True
        )
        self._thread.start()

    @property
    def lease(self) -> Lease:
        return self._lease

    def fencing_token(self) -> Fence:
        """The fencing token of this holding (constant while it lasts: renewals keep it)."""
        return self._lease.fencing_token()

    def ensure_held(self) -> Lease:
        """Prove the lease is still this run's, and extend it: call right before committing. A compare-and-swap
        in storage rather than a look at the clock: a run paused past its expiry either finds its lease
        untouched (and holds it again) or gets LeaseLost and must not commit."""
        with self._lock:
            if self._lost is None:
                try:
                    self._lease = renew(self._lease)
                except LeaseLost as exc:
                    self._lost = exc
            lost = self._lost
        if lost is not None:
            self._tell_lost(lost)
            raise LeaseLost(str(lost)) from lost
        return self._lease

    def on_lost(self, callback: Callable[[LeaseLost], None]) -> None:
        """Call ``callback`` once the lease is found lost (at once if it was): a holder stops the work the lease
        guards then, rather than finding out at its commit."""
        with self._lock:
            self._on_lost.append(callback)
            told = self._told
        if told and self._lost is not None:
            callback(self._lost)

    def lost(self) -> LeaseLost | None:
        """Why this run no longer holds the lease, or None while it does (``ensure_held``, without raising); a
        storage error on the way says nothing either way: None, and the caller's own error stands."""
        try:
            self.ensure_held()
        except LeaseLost as exc:
            return exc
        except Exception as exc:  # any failure to look (storage, a bad record) says nothing either way
            log.warning("checking the lease on %s failed (%s)", self._lease.guards, exc)
        return None

    def _renew_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with self._lock:
                if self._lost is not None:
                    return
                try:
                    self._lease = renew(self._lease)
                    continue
                except LeaseLost as exc:
                    self._lost = lost = exc
                except Exception as exc:  # a storage hiccup: the lease stays ours until it expires, so try again
                    log.warning("renewing the lease on %s failed (%s); trying again", self._lease.guards, exc)
                    continue
            log.warning("%s", lost)
            self._tell_lost(lost)
            return

    def _tell_lost(self, lost: LeaseLost) -> None:
        with self._lock:
            callbacks, self._told = ([] if self._told else list(self._on_lost)), True
        for callback in callbacks:
            try:
                callback(lost)
            except Exception as exc:  # one callback failing must not keep the others from stopping their work
                log.warning("stopping what the lease on %s guards failed: %s", self._lease.guards, exc)

    def close(self) -> None:
        """Stop renewing and release the lease (unless it was lost: then it is someone else's)."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            if self._lost is not None:
                log.warning("the lease on %s was lost while its block ran: %s", self._lease.guards, self._lost)
                return
            try:
                if not release(self._lease):
                    log.warning("the lease on %s was no longer this run's at release", self._lease.guards)
            except Exception as exc:  # never hide the block's own error; the lease expires by itself
                log.warning("releasing the lease on %s failed (%s); it expires by itself", self._lease.guards, exc)


@contextmanager
def held(
    uri: str,
    holder: str,
    *,
    ttl_s: float,
    wait_s: float,
    describe: str = "",
    renew_every_s: float | None = None,
    poll_max_s: float = 2.0,
) -> Iterator[HeldLease]:
    """Hold the lease on ``uri`` for the block: wait up to ``wait_s`` for it (then LeaseBusy, naming the
    holder), renew every ttl/3, release at exit. The block calls ``ensure_held()`` before it commits anything.
    """
    if ttl_s <= 0:
        raise ConfigError(f"a held lease needs a positive ttl, not {ttl_s} s")
    started = time.monotonic()
    lease = _wait_for(uri, holder, ttl_s, wait_s, describe, poll_max_s)
    handle = HeldLease(lease, waited_s=time.monotonic() - started, renew_every_s=renew_every_s or ttl_s / 3)
    try:
        yield handle
    finally:
        handle.close()


def _wait_for(uri: str, holder: str, ttl_s: float, wait_s: float, describe: str, poll_max_s: float) -> Lease:
    started = time.monotonic()
    delay = 0.05
    said = False
    while (lease := try_acquire(uri, holder, ttl_s, describe=describe)) is None:
        waited = time.monotonic() - started
        if not said:  # once: a run that sits waiting says on whom (the Prefect UI shows it)
            current = read(uri)
            who = "nobody now" if current is None else f"{current.holder}, expires in {current.expires_in():.0f} s"
            log.info("%s waits up to %.0f s for %s, held by %s", holder, wait_s, describe or uri, who)
            said = True
        if waited >= wait_s:
            raise _busy(uri, describe, waited)
        # jittered backoff: waiters neither poll in step nor hammer the storage
        time.sleep(min(wait_s - waited, delay * random.uniform(0.5, 1.0)))
        delay = min(poll_max_s, delay * 2)
    return lease


def _busy(uri: str, describe: str, waited_s: float) -> LeaseBusy:
    uri = storage.normalize(uri)
    current = read(uri)
    guards = describe or (current.guards if current is not None else uri)
    what = uri if guards == uri else f"{guards} at {uri}"
    if current is None or not current.is_live():
        who = "holder gone just now"
    else:
        who = f"holder {current.holder}, expires in {current.expires_in():.0f} s"
    message = f"another run holds {what} ({who}); waited {waited_s:.1f} s"
    return LeaseBusy(message, holder=current.holder if current is not None else None)


def _lost(lease: Lease) -> LeaseLost:
    current = read(lease.uri)
    if current is None or current.released:
        now = "another run took and released it since"
    else:
        now = f"now held by {current.holder} (expires in {current.expires_in():.0f} s)"
    return LeaseLost(f"{lease.holder} lost its lease on {lease.guards} ({lease.uri}): {now}; it must not commit")


def _swap(expected: Lease, new: Lease) -> Lease | None:
    token = conditional.replace_if_match(expected.uri, _body(new), expected.token)
    return None if token is None else replace(new, token=token)


def _body(lease: Lease) -> bytes:
    """Every field but where the lease is and which write it is (``uri``, ``token``)."""
    fields = {name: value for name, value in asdict(lease).items() if name not in ("uri", "token")}
    return json.dumps(fields, sort_keys=True).encode() + b"\n"


def _parse(uri: str, current: conditional.Versioned) -> Lease:
    try:
        body = json.loads(current.data)
        return Lease(
            uri=uri,
            holder=str(body["holder"]),
            guards=str(body.get("guards") or uri),
            # leases written before generations existed have only holder and expires_at
            acquired_at=float(body.get("acquired_at", 0.0)),
            expires_at=float(body["expires_at"]),
            ttl_s=float(body.get("ttl_s", 0.0)),
            generation=int(body.get("generation", 0)),
            token=current.token,
            released=bool(body.get("released", False)),
            # leases written before fences existed: the generation read is at least the one that took them
            fence=int(body.get("fence", body.get("generation", 0))),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise StorageError(f"lease {uri} is not a lease ({type(exc).__name__}: {exc}); remove it by hand") from exc
