"""What the ``serve-rollout`` flow reads and holds around its Ray tasks (``rayline.tasks.serve``): the
canary probes' default source, and the model's rollout lease."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from rayline import storage
from rayline.errors import LeaseBusy, RolloutRolledBack
from rayline.models import registry
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.serving.request import LEASE_TTL_S
from rayline.ray_workloads.serving.rollout import default_probe_source
from rayline.storage import leases
from rayline.tasks.common import io_task, lease_holder


@io_task("rollout-probe-source")
def probe_source_task(version: ModelVersion) -> str:
    """Where canary probes come from by default: ``version``'s training prefix, or its latest night's inputs."""
    return default_probe_source(version, storage.storage_root())


@contextmanager
def rollout_lease(model_name: str, wait_s: float, ttl_s: float = LEASE_TTL_S) -> Iterator[leases.HeldLease]:
    """Hold ``model_name``'s rollout lease for the ``with`` block: one rollout per model at a time.

    A second rollout (a trigger firing twice) waits up to ``wait_s``, then finds its work done; still busy
    then, it raises ``RolloutRolledBack`` naming the holder. Not a task, which would release it on return: it
    is held (renewed from its own thread) across every task of the rollout. ``ttl_s``: how long after its
    last renewal a killed rollout's lease is taken over.
    """
    held = leases.held(
        registry.rollout_lease_uri(model_name),
        lease_holder(),
        ttl_s=ttl_s,
        wait_s=wait_s,
        describe=registry.rollout_lease_what(model_name),
    )
    with ExitStack() as stack:
        try:
            lease = stack.enter_context(held)
        except LeaseBusy as exc:
            raise RolloutRolledBack(
                f"another rollout of {model_name} still holds the lease after {wait_s:.0f} s: {exc}"
            ) from exc
        yield lease  # the block's own errors pass through; the lease is released either way


@io_task("rollout-lease-holder")
def another_rollout_holds_task(model_name: str, holder: str) -> bool:
    """Whether the lease ``holder`` lost is live in another run's hands (a takeover), not lost to a storage error."""
    current = leases.read(registry.rollout_lease_uri(model_name))
    return current is not None and current.is_live() and current.holder != holder
