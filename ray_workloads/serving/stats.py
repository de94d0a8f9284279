"""Per-version request stats of a serving instance, kept by the control actor (``routing.ServeControl``).

Routers hand over one :data:`Sample` per answered prediction. Two views are read back:

* everything (``GET /stats``, ``control.stats``, the monitor): every answer a version
  gave, pinned or routed, including 4xx rejections of bad input;
* the *gate* view (``gated=True``, what a rollout judges a candidate on): only answers to
  requests the router routed by weight or key, and not 4xx. A client can pin
  (``X-Rayline-Version``) any live version, a candidate at 0 % included, and a 4xx is bad
  input, not the version's fault: counted, either would let junk meet the gate's
  ``min_requests`` and dilute its error rate. The rollout's own probes are routed (unpinned),
  so they count; its agreement check pins, and runs before the soak window it is judged on.

Standard library and numpy only (the control actor's process loads nothing else).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# outcome codes of a request sample
OK, ERROR, REJECTED = 0, 1, 2
SAMPLES_PER_VERSION = 200_000
# what a router hands over per request: model, version, unix time, latency ms, outcome, routed
# (False: pinned with X-Rayline-Version)
Sample = tuple[str, int, float, float, int, bool]


def counts_for_gate(outcome: int, routed: bool) -> bool:
    """Whether an answer is evidence about its version for the rollout gate (see the module docstring)."""
    return routed and outcome != REJECTED


@dataclass
class _Counts:
    """Running totals since the model's last reset (the window without ``since``)."""

    requests: int = 0
    errors: int = 0
    rejected: int = 0
    gate_requests: int = 0
    gate_errors: int = 0


# what the book keeps per answer: unix time, latency ms, outcome, counts for the gate
_Kept = tuple[float, float, int, bool]


class StatsBook:
    """Samples and totals per (model, version); samples older than a model's last reset are dropped."""

    def __init__(self, started: float) -> None:
        self._started = started
        self._samples: dict[tuple[str, int], deque[_Kept]] = {}
        self._counts: dict[tuple[str, int], _Counts] = {}
        self._since: dict[str, float] = {}  # per model: its last reset

    def record(self, samples: Iterable[Sample]) -> None:
        for sample in samples:
            model, version, ts, latency_ms, outcome = sample[:5]
            # a sample without the flag comes from a router of an older release: counted as before
            routed = bool(sample[5]) if len(sample) > 5 else True
            if ts < self._since.get(model, self._started):
                continue
            gate = counts_for_gate(outcome, routed)
            key = (model, version)
            self._samples.setdefault(key, deque(maxlen=SAMPLES_PER_VERSION)).append((ts, latency_ms, outcome, gate))
            counts = self._counts.setdefault(key, _Counts())
            counts.requests += 1
            counts.errors += outcome == ERROR
            counts.rejected += outcome == REJECTED
            counts.gate_requests += gate
            counts.gate_errors += gate and outcome == ERROR

    def stats(self, model: str | None, since: float | None = None, gated: bool = False) -> dict[int, dict[str, Any]]:
        """Per-version stats of ``model`` since its last reset, or since ``since``; ``gated``: the gate view."""
        out: dict[int, dict[str, Any]] = {}
        for (sampled, version), samples in self._samples.items():
            if sampled == model:
                out[version] = self._version_stats(version, samples, self._counts[(sampled, version)], since, gated)
        return dict(sorted(out.items()))

    @staticmethod
    def _version_stats(
        version: int, samples: deque[_Kept], counts: _Counts, since: float | None, gated: bool
    ) -> dict[str, Any]:
        rows = [s for s in samples if (since is None or s[0] >= since) and (s[3] or not gated)]
        if since is None and gated:
            requests, errors, rejected = counts.gate_requests, counts.gate_errors, 0
        elif since is None:
            requests, errors, rejected = counts.requests, counts.errors, counts.rejected
        else:
            requests = len(rows)
            errors = sum(1 for s in rows if s[2] == ERROR)
            rejected = sum(1 for s in rows if s[2] == REJECTED)
        ok_ms = np.array([s[1] for s in rows if s[2] == OK], dtype=np.float64)
        p50, p95, p99 = np.percentile(ok_ms, [50, 95, 99]).tolist() if ok_ms.size else (None, None, None)
        return {
            "version": version,
            "requests": requests,
            "errors": errors,
            "rejected": rejected,
            "p50_ms": p50,
            "p95_ms": p95,
            "p99_ms": p99,
        }

    def drop(self, model: str) -> None:
        for key in [k for k in self._samples if k[0] == model]:
            del self._samples[key]
            del self._counts[key]

    def reset(self, model: str, now: float) -> None:
        """A fresh window for ``model``: its samples go, and samples from before ``now`` are refused."""
        self.drop(model)
        self._since[model] = now
