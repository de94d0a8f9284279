"""A version's execution plan measured where the version is made, before its first night needs it.

A first night that measures its plan runs slower than its next (one actor measures and converts while the
others wait). Measuring in a Ray task holding a night actor's CPUs, on the version's sample images, caches the
plan under the key a night on the same hardware, libraries and policy looks up: that night adopts it. A night on
other hardware (a GPU node, another CPU) finds no plan for its key and measures its own, as before.
"""

from __future__ import annotations

from rayline.hardware import detect
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.execution.cache import plan_for, probe_set
from rayline.ray_workloads.execution.interface import (
    assigned_cpus,
    backends_at_hand,
    load_version,
    remote_options,
    torch_threads,
)
from rayline.ray_workloads.execution.plan import PlanChoice, PlanPolicy, candidates


def measure_ahead(version: ModelVersion, policy: PlanPolicy, cpus: float) -> PlanChoice | None:
    """The plan of ``version`` for a night actor holding ``cpus``, measured (or found cached) in a Ray task with
    the same CPUs on the cluster; None when the policy chooses nothing (off) or nothing can judge a plan."""
    import ray

    if policy.mode == "off":
        return None
    measure = ray.remote(num_cpus=cpus, max_retries=0)(_measure_here)
    found: PlanChoice | None = ray.get(measure.options(**remote_options(version.model_spec)).remote(version, policy))
    return found


def _measure_here(version: ModelVersion, policy: PlanPolicy) -> PlanChoice | None:
    """In the task: the version loaded on the threads a night actor of these CPUs runs, judged on its samples;
    nothing loaded where this CPU has no plan to measure (a night there runs fp32 unmeasured too)."""
    if not candidates(detect(with_gpu=False), "cpu", policy, backends_at_hand("cpu", policy)):
        return None
    model = load_version(version, threads=torch_threads(assigned_cpus()))
    probe = probe_set(version, version.image_spec)
    if probe is None:  # no samples and no stand-ins: the night measures on its own first images
        return None
    return plan_for(model, version.uri, probe, policy)
