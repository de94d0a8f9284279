"""How far a long stage has got, for whoever shows it (the CLI); a no-op everywhere else.

A workload wraps its long part in :func:`stage` and counts with the handle it gets (``add``/``set``). The CLI
installs a :class:`Reporter` that draws the counts; served deployments and tests install none, and every call
is then a no-op that costs nothing (no actor, no thread).

Counts made in other Ray processes (a Ray Data write task, the Ray Train controller) travel through one small
actor per showing process: a handle made with ``remote=True`` pickles with that actor, and the showing process
polls it. Progress is best effort: a lost update never fails a stage.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

POLL_S = 1.0  # how often counts made in other processes are fetched


class Reporter(Protocol):
    """What shows progress: one call when a stage starts, on each count, and when it ends."""

    def start(self, key: str, label: str, total: int | None, unit: str) -> None: ...

    def update(self, key: str, done: int) -> None: ...

    def finish(self, key: str, ok: bool) -> None: ...


_reporter: Reporter | None = None
_counts: dict[str, int] = {}
_counts_lock = threading.Lock()


def install(reporter: Reporter | None) -> None:
    """Show progress with ``reporter`` from now on (None: stop showing)."""
    global _reporter
    _reporter = reporter


def _count(key: str, done: int | None = None, add: int = 0) -> None:
    reporter = _reporter
    if reporter is None:
        return
    with _counts_lock:
        if key not in _counts:
            return  # the stage has ended (a late update from a straggler)
        _counts[key] = done if done is not None else _counts[key] + add
        now = _counts[key]
    reporter.update(key, now)


class _Tally:
    """Ray actor: counts of stages updated from other processes, by stage key."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, n: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def set(self, key: str, done: int) -> None:
        self.counts[key] = done

    def get(self, key: str) -> int | None:
        return self.counts.get(key)


@dataclass(frozen=True)
class Stage:
    """A stage's counter; picklable. In the showing process it counts directly, elsewhere through the tally actor."""

    key: str = ""
    tally: Any = None  # the tally actor's handle, for counts made in other processes

    def add(self, n: int = 1) -> None:
        self._update(add=n)

    def set(self, done: int) -> None:
        self._update(done=done)

    def _update(self, done: int | None = None, add: int = 0) -> None:
        if not self.key:
            return
        if _reporter is not None:
            _count(self.key, done, add)
        elif self.tally is not None:
            tally, key = self.tally, self.key
            _remote(lambda: tally.add.remote(key, add) if done is None else tally.set.remote(key, done))


def _remote(call: Any) -> None:
    try:
        call()
    except Exception:  # noqa: S110 - progress is best effort: a lost count must not fail the stage
        pass


_tally_actor: Any = None
_tally_cluster: str | None = None


def _tally() -> Any:
    """This process's tally actor, started on first use (0 CPUs: it never waits for the stage's own work), one per
    Ray connection: the handle of a cluster the process left cannot be serialised (Ray aborts the process)."""
    global _tally_actor, _tally_cluster
    import ray

    context = ray.get_runtime_context()
    cluster = f"{context.gcs_address}/{context.get_job_id()}"
    if _tally_actor is None or _tally_cluster != cluster:
        _tally_actor = ray.remote(num_cpus=0)(_Tally).remote()
        _tally_cluster = cluster
    return _tally_actor


def _tally_or_none() -> Any:
    try:
        return _tally()
    except Exception:  # no Ray connection: the stage is shown without counts from other processes
        return None


def _poll(stage: Stage, stop: threading.Event) -> None:
    while not stop.wait(POLL_S):
        _remote(lambda: _fetch(stage, POLL_S * 10))  # a failed fetch is tried again on the next tick


def _fetch(stage: Stage, timeout_s: float) -> None:
    """Show the count of ``stage`` that its tally actor holds."""
    import ray

    done = ray.get(stage.tally.get.remote(stage.key), timeout=timeout_s)
    if done is not None:
        _count(stage.key, done=int(done))


@contextmanager
def stage(label: str, total: int | None = None, unit: str = "rows", remote: bool = False) -> Iterator[Stage]:
    """A long stage: yields its counter; the reporter (if any) shows ``label`` and ``done``/``total`` ``unit``.
    ``remote``: the counter is also used in other Ray processes (needs a Ray connection)."""
    reporter = _reporter
    if reporter is None:
        yield Stage()
        return
    key = f"{label}#{uuid.uuid4().hex}"  # unique across processes: a pickled counter may outlive its run
    with _counts_lock:
        _counts[key] = 0
    handle = Stage(key, _tally_or_none() if remote else None)
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(handle, stop), daemon=True) if handle.tally is not None else None
    reporter.start(key, label, total, unit)
    if poller is not None:
        poller.start()
    ok = False
    try:
        yield handle
        ok = True
    finally:
        stop.set()
        if poller is not None:
            poller.join(timeout=POLL_S * 2)
        if ok and handle.tally is not None:  # the last counts, which the poller may not have fetched yet
            _remote(lambda: _fetch(handle, 10))
        reporter.finish(key, ok)
        with _counts_lock:
            _counts.pop(key, None)
