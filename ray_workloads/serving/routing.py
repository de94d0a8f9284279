"""The routing table and request stats of a serving instance, held by the control actor.

The control actor (``ServeControl``: one per instance, ``<name>-control`` in rayline's namespace,
detached) is the single writer of the routing table: its calls are serialised, so a weight change
is atomic. It snapshots the table to Ray's internal KV store on every change and restores it if Ray
restarts it, so routers never see the table vanish.

The table holds, per model, its live versions' applications and weights (:class:`ModelRoutes`),
and the *default model* ``POST /predict`` goes to: the one configured (:meth:`ServeControl.set_default`,
``RAYLINE_SERVE_DEFAULT_MODEL``), else the first registered that is still served.

Router replicas (``ingress.Router``) sync periodically (:meth:`ServeControl.sync`): samples in, table
out, under their Serve replica id. A table change waits for each router replica Serve runs now, however
long it has been silent (it routes by its old table the moment it resumes), not for one it no longer runs.

A rollout's changes carry its lease's fencing token (``rayline.storage.fencing``): the actor keeps the
newest per lease, in its snapshot too, and refuses an older one (``StaleFence``), so a rollout paused past
its lease's ttl cannot move traffic over the rollout that took over.

This module imports neither Serve's HTTP stack nor torch: it is all the actor's process loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.experimental import internal_kv

from rayline.errors import ConfigError
from rayline.ray_cluster import NAMESPACE
from rayline.ray_workloads.serving.stats import Sample, StatsBook
from rayline.storage.fencing import Fence, admit

# a router silent this long is forgotten (memory only: which routers are waited for is Serve's membership)
ROUTER_FORGET_S = 600.0


@dataclass(frozen=True)
class RouterSync:
    """A router's last sync: when (the actor's monotonic clock) and the table generation it had then."""

    at: float
    generation: int


def routers_behind(seen: Mapping[str, RouterSync], members: Iterable[str], generation: int) -> list[str]:
    """The routers of ``members`` (the router replicas Serve runs) not routing by ``generation`` yet: one never
    seen (just started, or the actor restarted) is behind until its next sync; a non-member is not waited for."""
    return sorted(r for r in set(members) if r not in seen or seen[r].generation < generation)


def routers_not_synced_since(seen: Mapping[str, RouterSync], members: Iterable[str], mark: float) -> list[str]:
    """The routers of ``members`` whose last sync (their samples' flush) is not after ``mark``."""
    return sorted(r for r in set(members) if r not in seen or seen[r].at <= mark)


@dataclass(frozen=True)
class ModelRoutes:
    """One model's live versions: their Serve applications and traffic weights."""

    weights: dict[int, float] = field(default_factory=dict)
    apps: dict[int, str] = field(default_factory=dict)

    def keep(self, versions: set[int]) -> ModelRoutes:
        """The routes of ``versions`` alone."""
        return ModelRoutes(
            weights={v: w for v, w in self.weights.items() if v in versions},
            apps={v: a for v, a in self.apps.items() if v in versions},
        )


@dataclass(frozen=True)
class RoutingTable:
    """What routers route by; replaced as a whole (one generation) on every change. ``models`` keeps
    registration order; ``configured_default`` may not be served (yet)."""

    generation: int = 0
    models: dict[str, ModelRoutes] = field(default_factory=dict)
    configured_default: str | None = None

    @property
    def default_model(self) -> str | None:
        """The model ``/predict`` answers with: the configured one, else the first one served."""
        if self.configured_default is not None:
            return self.configured_default
        return next(iter(self.models), None)

    def resolve(self, model: str | None) -> str | None:
        return self.default_model if model is None else model

    def routes(self, model: str | None) -> ModelRoutes:
        """The routes of ``model`` (None: the default); empty when it is not served."""
        name = self.resolve(model)
        return self.models.get(name, ModelRoutes()) if name is not None else ModelRoutes()

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "configured_default": self.configured_default,
            "models": {m: {"weights": r.weights, "apps": r.apps} for m, r in self.models.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoutingTable:
        if "models" not in data:  # a snapshot written when an instance served one model
            model = data.get("model")
            old = {"weights": data.get("weights", {}), "apps": data.get("apps", {})}
            data = {"generation": data["generation"], "models": {model: old} if model and old["apps"] else {}}
        return cls(
            generation=int(data["generation"]),
            configured_default=data.get("configured_default"),
            models={
                m: ModelRoutes(
                    weights={int(v): float(w) for v, w in r["weights"].items()},
                    apps={int(v): str(a) for v, a in r["apps"].items()},
                )
                for m, r in data["models"].items()
            },
        )


def choose_version(weights: Mapping[int, float], key: str | None, rng: random.Random) -> int | None:
    """Weighted choice; with a key, deterministic (hash of the key), so one key sees one version."""
    live = [(v, w) for v, w in sorted(weights.items()) if w > 0]
    if not live:
        return None
    total = sum(w for _, w in live)
    if key:
        point = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
    else:
        point = rng.random()
    point *= total
    acc = 0.0
    for version, weight in live:
        acc += weight
        if point < acc:
            return version
    return live[-1][0]


class ServeControl:
    """Routing table and request stats of one serving instance (runs as a detached Ray actor)."""

    def __init__(self, name: str) -> None:
        self._kv_key = f"{name}-routing-table"
        self._table = RoutingTable()
        self._router_config: dict[str, Any] | None = None
        self._fences: dict[str, Fence] = {}  # the newest fencing token seen per lease
        saved = internal_kv._internal_kv_get(self._kv_key, namespace=NAMESPACE)
        if saved:
            data = json.loads(saved)
            self._table = RoutingTable.from_json(data)
            self._router_config = data.get("router_config")
            self._fences = {f["lease"]: Fence(**f) for f in data.get("fences", [])}
        self._routers: dict[str, RouterSync] = {}  # by Serve replica id
        self._stats = StatsBook(started=time.time())

    def _replace(self, **changes: Any) -> int:
        self._table = dataclasses.replace(self._table, generation=self._table.generation + 1, **changes)
        self._save()
        return self._table.generation

    def _with_model(self, model: str, routes: ModelRoutes | None) -> int:
        """A new generation with ``model``'s routes replaced (None or no versions left: model removed)."""
        models = dict(self._table.models)
        if routes is None or not routes.apps:
            models.pop(model, None)
        else:
            models[model] = routes
        return self._replace(models=models)

    def _save(self) -> None:
        data = {
            **self._table.to_json(),
            "router_config": self._router_config,
            "fences": [dataclasses.asdict(f) for f in self._fences.values()],
        }
        internal_kv._internal_kv_put(self._kv_key, json.dumps(data), overwrite=True, namespace=NAMESPACE)

    def _served(self, model: str | None) -> tuple[str, ModelRoutes]:
        """``model`` (None: the default) and its routes; a clear error when it is not served."""
        name = self._table.resolve(model)
        if name is None or name not in self._table.models:
            served = sorted(self._table.models)
            what = f"model {name!r} is" if name is not None else "no model is"
            raise ConfigError(f"{what} not served by this instance; served models: {served}")
        return name, self._table.models[name]

    def _admit(self, fence: Fence | None, what: str) -> None:
        """Refuse ``what`` under a fence older than one seen (``StaleFence``); remember the newest."""
        if admit(self._fences, fence, what):
            self._save()  # before the change it admits: a restarted actor must still refuse the older one

    def forget(self) -> None:
        internal_kv._internal_kv_del(self._kv_key, namespace=NAMESPACE)

    def table(self) -> RoutingTable:
        return self._table

    def swap_router_config(self, config: dict[str, Any] | None) -> dict[str, Any] | None:
        """Record the router config about to be deployed (None: unknown); the one recorded before (atomic)."""
        before, self._router_config = self._router_config, config
        self._save()
        return before

    def set_default(self, model: str | None) -> int:
        """Configure the default model (None: the first one served); it need not be served yet."""
        if model == self._table.configured_default:
            return self._table.generation
        return self._replace(configured_default=model)

    def sync(self, router_id: str, generation: int, samples: list[Sample]) -> RoutingTable:
        """A router's periodic call: record its samples, note what it has seen, hand it the table."""
        now = time.monotonic()
        self._routers[router_id] = RouterSync(now, generation)
        self._routers = {r: seen for r, seen in self._routers.items() if now - seen.at < ROUTER_FORGET_S}
        self._stats.record(samples)
        return self._table

    def routers_behind(self, generation: int, members: list[str]) -> list[str]:
        """Of ``members`` (the router replicas Serve runs), those not routing by ``generation`` yet."""
        return routers_behind(self._routers, members, generation)

    def clock(self) -> float:
        return time.monotonic()

    def routers_not_synced_since(self, mark: float, members: list[str]) -> list[str]:
        """Of ``members``, those that have not flushed their samples since ``mark`` (:meth:`clock`)."""
        return routers_not_synced_since(self._routers, members, mark)

    def register(self, model: str, version: int, app: str, fence: Fence | None = None) -> int:
        """Add a live version of ``model`` at weight 0 (a new model is served from then on)."""
        self._admit(fence, f"registering v{version} of {model}")
        routes = self._table.models.get(model, ModelRoutes())
        if routes.apps.get(version) == app:
            return self._table.generation
        weights = {**routes.weights, version: routes.weights.get(version, 0.0)}
        return self._with_model(model, ModelRoutes(weights=weights, apps={**routes.apps, version: app}))

    def set_weights(self, weights: dict[int, float], model: str | None = None, fence: Fence | None = None) -> int:
        self._admit(fence, f"setting weights {weights} of {self._table.resolve(model)}")
        name, routes = self._served(model)
        unknown = sorted(set(weights) - set(routes.apps))
        if unknown:
            raise ConfigError(f"versions {unknown} of {name} are not live; live versions: {sorted(routes.apps)}")
        bad = {v: w for v, w in weights.items() if not (math.isfinite(w) and w >= 0)}
        if bad:
            raise ConfigError(f"weights must be finite and >= 0, got {bad}")
        if sum(weights.values()) <= 0:
            raise ConfigError("weights must sum to more than 0 (some version must take traffic)")
        new = {v: float(weights.get(v, 0.0)) for v in routes.apps}
        if new == routes.weights:
            return self._table.generation
        return self._with_model(name, dataclasses.replace(routes, weights=new))

    def retire(self, version: int, model: str | None = None, fence: Fence | None = None) -> int:
        """Take a version out of the table (it must have no traffic weight); its model goes with its last one."""
        name = self._table.resolve(model)
        self._admit(fence, f"retiring v{version} of {name}")
        routes = self._table.models.get(name) if name is not None else None
        if name is None or routes is None or version not in routes.apps:
            return self._table.generation
        if routes.weights.get(version, 0.0) > 0:
            raise ConfigError(
                f"version {version} of {name} still has weight {routes.weights[version]}; set it to 0 first"
            )
        return self._with_model(name, routes.keep(set(routes.apps) - {version}))

    def remove_model(self, model: str) -> tuple[int, list[str]]:
        """Stop routing to every version of ``model`` at once; (generation, its applications)."""
        _, routes = self._served(model)
        apps = list(routes.apps.values())
        generation = self._with_model(model, None)
        self._stats.drop(model)
        return generation, apps

    def prune(self, present: list[str]) -> int:
        """Forget versions whose application is gone (Serve was shut down behind our back)."""
        models = {m: r.keep({v for v, a in r.apps.items() if a in present}) for m, r in self._table.models.items()}
        models = {m: r for m, r in models.items() if r.apps}
        if models == self._table.models:
            return self._table.generation
        return self._replace(models=models)

    def stats(
        self, since: float | None = None, model: str | None = None, gated: bool = False
    ) -> dict[int, dict[str, Any]]:
        """Per-version stats of ``model`` (None: the default) since its last reset, or since ``since``;
        ``gated``: only what counts toward a rollout's gate (``stats``)."""
        return self._stats.stats(self._table.resolve(model), since, gated)

    def reset_stats(self, model: str | None = None) -> float:
        """Start a fresh stats window for ``model`` (None: the default); other models keep theirs."""
        name = self._table.resolve(model)
        now = time.time()
        if name is not None:
            self._stats.reset(name, now)
        return now
