"""The routing table and request stats of a serving instance, held by the control actor.

The control actor (``ServeControl``, one per serving instance, named ``<name>-control`` in
rayline's namespace, detached) is the single writer of the routing table: calls to it are
serialised, so a weight change is atomic. It snapshots the table to Ray's internal KV store
on every change and restores it if Ray restarts it, so routers never see the table vanish.

Router replicas (``serve_app.Router``) call :meth:`ServeControl.sync` periodically: they hand
over their request samples and get the current :class:`RoutingTable` back. The driver side
(``serve_control``) creates the actor and calls the rest.

This module imports neither Serve's HTTP stack nor torch: it is all the actor's process loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ray.experimental import internal_kv

from rayline.errors import ConfigError
from rayline.ray_cluster import NAMESPACE

# outcome codes of a request sample
OK, ERROR, REJECTED = 0, 1, 2
ROUTER_STALE_S = 5.0  # a router silent this long is gone (killed, scaled down)
SAMPLES_PER_VERSION = 200_000


@dataclass(frozen=True)
class RoutingTable:
    """What routers route by; replaced as a whole (one generation) on every change."""

    generation: int = 0
    model: str | None = None
    weights: dict[int, float] = field(default_factory=dict)
    apps: dict[int, str] = field(default_factory=dict)


class ServeControl:
    """Routing table and request stats of one serving instance (runs as a detached Ray actor)."""

    def __init__(self, name: str) -> None:
        self._kv_key = f"{name}-routing-table"
        self._table = RoutingTable()
        self._router_config: dict[str, Any] | None = None
        saved = internal_kv._internal_kv_get(self._kv_key, namespace=NAMESPACE)
        if saved:
            data = json.loads(saved)
            self._table = RoutingTable(
                generation=data["generation"],
                model=data["model"],
                weights={int(v): float(w) for v, w in data["weights"].items()},
                apps={int(v): a for v, a in data["apps"].items()},
            )
            self._router_config = data.get("router_config")
        self._routers: dict[str, tuple[float, int]] = {}
        self._samples: dict[int, deque[tuple[float, float, int]]] = {}
        self._counts: dict[int, list[int]] = {}
        self._since = time.time()

    def _replace(self, **changes: Any) -> int:
        self._table = dataclasses.replace(self._table, generation=self._table.generation + 1, **changes)
        self._save()
        return self._table.generation

    def _save(self) -> None:
        table = self._table
        data = {
            "generation": table.generation,
            "model": table.model,
            "weights": table.weights,
            "apps": table.apps,
            "router_config": self._router_config,
        }
        internal_kv._internal_kv_put(self._kv_key, json.dumps(data), overwrite=True, namespace=NAMESPACE)

    def forget(self) -> None:
        internal_kv._internal_kv_del(self._kv_key, namespace=NAMESPACE)

    def table(self) -> RoutingTable:
        return self._table

    def swap_router_config(self, config: dict[str, Any] | None) -> dict[str, Any] | None:
        """Record the router config about to be deployed (None: unknown); the one recorded before (atomic)."""
        before, self._router_config = self._router_config, config
        self._save()
        return before

    def sync(self, router_id: str, generation: int, samples: list[tuple[int, float, float, int]]) -> RoutingTable:
        """A router's periodic call: record its samples, note what it has seen, hand it the table."""
        now = time.monotonic()
        self._routers[router_id] = (now, generation)
        self._routers = {r: seen for r, seen in self._routers.items() if now - seen[0] < ROUTER_STALE_S}
        for version, ts, latency_ms, outcome in samples:
            if ts < self._since:
                continue
            self._samples.setdefault(version, deque(maxlen=SAMPLES_PER_VERSION)).append((ts, latency_ms, outcome))
            counts = self._counts.setdefault(version, [0, 0, 0])
            counts[0] += 1
            counts[1] += outcome == ERROR
            counts[2] += outcome == REJECTED
        return self._table

    def routers_behind(self, generation: int) -> list[str]:
        now = time.monotonic()
        return [r for r, (seen_at, gen) in self._routers.items() if now - seen_at < ROUTER_STALE_S and gen < generation]

    def clock(self) -> float:
        return time.monotonic()

    def routers_not_synced_since(self, mark: float) -> list[str]:
        now = time.monotonic()
        return [r for r, (seen_at, _) in self._routers.items() if now - seen_at < ROUTER_STALE_S and seen_at <= mark]

    def register(self, model: str, version: int, app: str) -> int:
        table = self._table
        if table.model is not None and table.model != model and table.apps:
            raise ConfigError(f"this serving instance serves model {table.model!r}, not {model!r}")
        if table.apps.get(version) == app:
            return table.generation
        return self._replace(
            model=model,
            apps={**table.apps, version: app},
            weights={**table.weights, version: table.weights.get(version, 0.0)},
        )

    def set_weights(self, weights: dict[int, float]) -> int:
        table = self._table
        unknown = sorted(set(weights) - set(table.apps))
        if unknown:
            raise ConfigError(f"versions {unknown} are not live; live versions: {sorted(table.apps)}")
        bad = {v: w for v, w in weights.items() if not (math.isfinite(w) and w >= 0)}
        if bad:
            raise ConfigError(f"weights must be finite and >= 0, got {bad}")
        if sum(weights.values()) <= 0:
            raise ConfigError("weights must sum to more than 0 (some version must take traffic)")
        new = {v: float(weights.get(v, 0.0)) for v in table.apps}
        if new == table.weights:
            return table.generation
        return self._replace(weights=new)

    def retire(self, version: int) -> int:
        """Take a version out of the table (it must have no traffic weight)."""
        table = self._table
        if version not in table.apps:
            return table.generation
        if table.weights.get(version, 0.0) > 0:
            raise ConfigError(f"version {version} still has weight {table.weights[version]}; set it to 0 first")
        apps = {v: a for v, a in table.apps.items() if v != version}
        weights = {v: w for v, w in table.weights.items() if v != version}
        return self._replace(apps=apps, weights=weights, model=table.model if apps else None)

    def prune(self, present: list[str]) -> int:
        """Forget versions whose application is gone (Serve was shut down behind our back)."""
        table = self._table
        gone = [v for v, app in table.apps.items() if app not in present]
        if not gone:
            return table.generation
        apps = {v: a for v, a in table.apps.items() if v not in gone}
        weights = {v: w for v, w in table.weights.items() if v not in gone}
        return self._replace(apps=apps, weights=weights, model=table.model if apps else None)

    def stats(self, since: float | None = None) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for version, samples in self._samples.items():
            rows = [s for s in samples if since is None or s[0] >= since]
            if since is None:
                requests, errors, rejected = self._counts[version]
            else:
                requests = len(rows)
                errors = sum(1 for s in rows if s[2] == ERROR)
                rejected = sum(1 for s in rows if s[2] == REJECTED)
            ok_ms = np.array([s[1] for s in rows if s[2] == OK], dtype=np.float64)
            p50, p95, p99 = np.percentile(ok_ms, [50, 95, 99]).tolist() if ok_ms.size else (None, None, None)
            out[version] = {
                "version": version,
                "requests": requests,
                "errors": errors,
                "rejected": rejected,
                "p50_ms": p50,
                "p95_ms": p95,
                "p99_ms": p99,
            }
        return out

    def reset_stats(self) -> float:
        self._samples.clear()
        self._counts.clear()
        self._since = time.time()
        return self._since
