"""Per-version request stats of a serving instance, kept by the control actor (``routing.ServeControl``).

Routers hand over one :data:`Sample` per answered prediction. Two views are read back: everything
(``GET /stats``, the monitor), 4xx rejections of bad input and pinned requests included; and the *gate*
view (``gated=True``, what a rollout judges a candidate on): only answers the router routed by weight or
key, and not 4xx. A client can pin (``X-Rayline-Version``) any live version, a candidate at 0 % included,
and a 4xx is bad input, not the version's fault: counted, either would let junk meet the gate's
``min_requests`` and dilute its error rate.

No sample is kept: the control actor answers every router's sync one call at a time, so a stats read must
cost the same however much traffic a version had. Per version the book keeps a running :class:`Tally`
since the model's last reset (counts, and a histogram of successful answers' latencies with each bin's
latency sum), and a snapshot of it at the start of every ``BUCKET_S`` window that saw an answer, for the
last ``WINDOW_S``. Stats since ``since`` are the running tally minus the snapshot of the window holding it:
``since`` counts from the start of its second; one older than the windows kept, from the oldest kept; one
at or before the last reset (or none), from the reset. A percentile is the mean latency of the bin holding
it, within the bin's width (``LATENCY_RATIO``). A snapshot is about 7 KB: a version answering every
second holds about 6 MB. Standard library and numpy only (all the control actor's process loads).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

# outcome codes of a request sample
OK, ERROR, REJECTED = 0, 1, 2
# what a router hands over per request: model, version, unix time, latency ms, outcome, routed
# (False: pinned with X-Rayline-Version)
Sample = tuple[str, int, float, float, int, bool]

BUCKET_S = 1.0  # the grain of ``since``
WINDOW_S = 900.0  # how far back ``since`` is counted from its own second (a rollout's soak is shorter)
# latency bins: bin 0 below LATENCY_MIN_MS, then each LATENCY_RATIO wider up to LATENCY_MAX_MS, then the rest
LATENCY_MIN_MS, LATENCY_MAX_MS, LATENCY_RATIO = 0.05, 600_000.0, 1.08
_EDGES = np.exp(np.arange(math.log(LATENCY_MIN_MS), math.log(LATENCY_MAX_MS), math.log(LATENCY_RATIO)))
BINS = len(_EDGES) + 1
# a tally's layout: counts, then per latency bin the answers and their latency sum, for everything and the gate
_REQUESTS, _ERRORS, _REJECTED, _GATE_REQUESTS, _GATE_ERRORS = range(5)
_HIST = 5
_ALL_N, _ALL_SUM, _GATE_N, _GATE_SUM = (_HIST + k * BINS for k in range(4))
_SIZE = _HIST + 4 * BINS

Tally = npt.NDArray[np.float64]


def _tally(latency_ms: npt.NDArray[np.float64], outcome: npt.NDArray[np.int64], gate: npt.NDArray[np.bool_]) -> Tally:
    """The tally of some answers (one array entry each)."""
    out = np.zeros(_SIZE)
    out[_REQUESTS] = len(outcome)
    out[_ERRORS] = np.count_nonzero(outcome == ERROR)
    out[_REJECTED] = np.count_nonzero(outcome == REJECTED)
    out[_GATE_REQUESTS] = np.count_nonzero(gate)
    out[_GATE_ERRORS] = np.count_nonzero(gate & (outcome == ERROR))
    ok = outcome == OK
    for n_at, sum_at, chosen in ((_ALL_N, _ALL_SUM, ok), (_GATE_N, _GATE_SUM, ok & gate)):
        ms = latency_ms[chosen]
        bins = np.searchsorted(_EDGES, ms, side="right")
        out[n_at : n_at + BINS] = np.bincount(bins, minlength=BINS)
        out[sum_at : sum_at + BINS] = np.bincount(bins, weights=ms, minlength=BINS)
    return out


def _percentiles(counts: Tally, sums: Tally) -> tuple[float | None, float | None, float | None]:
    """p50, p95, p99: the mean latency of the bin holding each rank (numpy's linear rank, n - 1 based)."""
    counts = np.rint(counts)  # a difference of float sums: whole numbers again
    n = int(counts.sum())
    if n == 0:
        return None, None, None
    cumulative = np.cumsum(counts)
    found: list[float] = []
    for q in (0.50, 0.95, 0.99):
        at = int(np.searchsorted(cumulative, math.floor(q * (n - 1)) + 1))
        found.append(float(sums[at] / counts[at]))
    return found[0], found[1], found[2]


@dataclass
class _Ledger:
    """One version's running tally since its model's reset, and its snapshots at window starts."""

    total: Tally = field(default_factory=lambda: np.zeros(_SIZE))
    windows: list[int] = field(default_factory=list)  # window numbers (unix time // BUCKET_S), ascending
    before: list[Tally] = field(default_factory=list)  # per window: the tally of every answer before it

    def add(self, window: int, tally: Tally) -> None:
        """Answers of ``window``: into the total, and into the snapshot of every later window (a late flush)."""
        at = bisect.bisect_left(self.windows, window)
        if at == len(self.windows) or self.windows[at] != window:  # no answer in it yet: it starts as the next
            self.windows.insert(at, window)
            self.before.insert(at, (self.before[at] if at < len(self.before) else self.total).copy())
        for later in self.before[at + 1 :]:
            later += tally
        self.total += tally

    def drop_before(self, window: int) -> None:
        cut = bisect.bisect_left(self.windows, window)
        del self.windows[:cut], self.before[:cut]

    def since(self, window: int) -> Tally:
        at = bisect.bisect_left(self.windows, window)
        if at == len(self.windows):
            return np.zeros(_SIZE)  # no answer since
        return self.total - self.before[at]


class StatsBook:
    """Tallies per (model, version) since each model's last reset; samples older than it are refused."""

    def __init__(self, started: float) -> None:
        self._started = started
        self._ledgers: dict[tuple[str, int], _Ledger] = {}
        self._since: dict[str, float] = {}  # per model: its last reset
        self._newest = 0  # the newest window seen: windows older by WINDOW_S go

    def record(self, samples: Iterable[Sample]) -> None:
        """Tally a router's flush: one numpy pass over the samples, then one tally per version and second."""
        rows = list(samples)
        if not rows:
            return
        keys: dict[tuple[str, int], int] = {}
        n = len(rows)
        key = np.fromiter((keys.setdefault((r[0], r[1]), len(keys)) for r in rows), np.int64, n)
        ts = np.fromiter((r[2] for r in rows), np.float64, n)
        latency = np.fromiter((r[3] for r in rows), np.float64, n)
        outcome = np.fromiter((r[4] for r in rows), np.int64, n)
        routed = np.fromiter((bool(r[5]) for r in rows), np.bool_, n)
        gate = routed & (outcome != REJECTED)  # evidence for the rollout gate (the module docstring)
        refused_before = np.array([self._since.get(model, self._started) for model, _ in keys])
        kept = ts >= refused_before[key]  # samples from before their model's last reset are refused
        window = np.floor(ts / BUCKET_S).astype(np.int64)
        order = np.lexsort((window, key))
        order = order[kept[order]]
        if order.size == 0:
            return
        # one tally per (version, window): the runs of equal (key, window) in that order
        split = np.flatnonzero((np.diff(key[order]) != 0) | (np.diff(window[order]) != 0)) + 1
        by_index = list(keys)
        for run in np.split(order, split):
            ledger = self._ledgers.setdefault(by_index[int(key[run[0]])], _Ledger())
            ledger.add(int(window[run[0]]), _tally(latency[run], outcome[run], gate[run]))
        self._newest = max(self._newest, int(window[order].max()))
        oldest = self._newest - int(WINDOW_S / BUCKET_S)
        for ledger in self._ledgers.values():
            ledger.drop_before(oldest)

    def stats(self, model: str | None, since: float | None = None, gated: bool = False) -> dict[int, dict[str, Any]]:
        """Per-version stats of ``model`` since its last reset, or since ``since``; ``gated``: the gate view."""
        reset = self._since.get(model, self._started) if model is not None else self._started
        window = None if since is None or since <= reset else math.floor(since / BUCKET_S)  # None: since the reset
        out: dict[int, dict[str, Any]] = {}
        for (sampled, version), ledger in self._ledgers.items():
            if sampled == model:
                tally = ledger.total if window is None else ledger.since(window)
                out[version] = _version_stats(version, tally, gated)
        return dict(sorted(out.items()))

    def windows_kept(self) -> int:
        """How many window snapshots the book holds, over every version (its memory, in windows)."""
        return sum(len(ledger.windows) for ledger in self._ledgers.values())

    def drop(self, model: str) -> None:
        for key in [k for k in self._ledgers if k[0] == model]:
            del self._ledgers[key]

    def reset(self, model: str, now: float) -> None:
        """A fresh window for ``model``: its tallies go, and samples from before ``now`` are refused."""
        self.drop(model)
        self._since[model] = now


def _version_stats(version: int, tally: Tally, gated: bool) -> dict[str, Any]:
    if gated:
        requests, errors, rejected, n_at, sum_at = tally[_GATE_REQUESTS], tally[_GATE_ERRORS], 0.0, _GATE_N, _GATE_SUM
    else:
        requests, errors, rejected, n_at, sum_at = tally[_REQUESTS], tally[_ERRORS], tally[_REJECTED], _ALL_N, _ALL_SUM
    p50, p95, p99 = _percentiles(tally[n_at : n_at + BINS], tally[sum_at : sum_at + BINS])
    return {
        "version": version,
        "requests": round(requests),
        "errors": round(errors),
        "rejected": round(rejected),
        "p50_ms": p50,
        "p95_ms": p95,
        "p99_ms": p99,
    }
