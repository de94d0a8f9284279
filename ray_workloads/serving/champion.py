"""Whether serving agrees with the registry: the version with the most traffic should be the champion.

A rollout moves traffic before the champion alias, so while one holds the model's rollout lease a
candidate with the most traffic is its soak, not a fault. With none holding it, most traffic on another
version was left by a rollout that did not finish (nightly inference uses the champion while online
clients get another model, until the next serve-rollout rolls it back): the monitor reports it unhealthy.
"""

from __future__ import annotations

from rayline.models import registry
from rayline.ray_workloads.monitoring.monitor import ServingHealth
from rayline.storage import leases


def check_champion(health: ServingHealth, champion: int | None, rollout_holder: str | None) -> ServingHealth:
    """``health`` judged also against the registry's ``champion``; ``rollout_holder``: who holds the
    model's rollout lease now (None: nobody, or a dead holder whose lease expired)."""
    weighted = [v for v in health.versions if v.weight > 0]
    checked = health.model_copy(update={"champion": champion})
    if champion is None or not weighted or rollout_holder is not None:
        return checked
    top = max(weighted, key=lambda v: v.weight)
    if top.version == champion or any(v.version == champion and v.weight == top.weight for v in weighted):
        return checked
    share = 100.0 * top.weight / sum(v.weight for v in weighted)
    problem = (
        f"v{top.version} has the most traffic ({share:g}%) but the registry's champion is v{champion}, and no "
        "rollout holds the model's lease: a rollout that did not finish left it (the next serve-rollout rolls "
        "it back to the champion)"
    )
    problems = problem if health.problem is None else f"{health.problem}; {problem}"
    return checked.model_copy(update={"healthy": False, "champion_mismatch": True, "problem": problems})


def serving_against_registry(health: ServingHealth, model: str) -> ServingHealth:
    """:func:`check_champion` with the champion alias and the rollout lease read from the registry."""
    if not health.served or not health.reachable:
        return health
    lease = leases.read(registry.rollout_lease_uri(model))
    holder = lease.holder if lease is not None and lease.is_live() else None  # None: released or expired
    return check_champion(health, registry.alias_version(model, registry.CHAMPION), holder)
