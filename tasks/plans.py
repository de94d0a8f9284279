"""Prefect task: a new version's execution plan, measured before its first night needs it
(:mod:`rayline.ray_workloads.execution.ahead`)."""

from __future__ import annotations

from prefect import get_run_logger

from rayline import ray_cluster
from rayline.config import deployment_request
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.execution.ahead import measure_ahead
from rayline.ray_workloads.execution.plan import PlanChoice
from rayline.ray_workloads.nightly.request import NightRequest
from rayline.tasks.common import maintenance_task

# a ResNet-50's measurement, its OpenVINO conversion included, takes 10-30 s on 2 cores; a queue behind a busy
# cluster's CPUs waits too
MEASURE_TIMEOUT_S = 900


@maintenance_task("measure-plan", timeout_s=MEASURE_TIMEOUT_S)
def measure_plan_task(version: ModelVersion) -> PlanChoice | None:
    """Measure the plan the scheduled nights will run ``version`` with: their plan policy, on a night actor's
    CPUs (the nightly deployment's request). Best effort: a failure is logged and the first night measures."""
    logger = get_run_logger()
    try:
        night = NightRequest.model_validate(deployment_request("nightly-inference", NightRequest))
        ray_cluster.connect()
        choice = measure_ahead(version, night.plan, night.shape.cpus_per_actor)
    except Exception as exc:  # noqa: BLE001 - the model, the cluster or a backend may raise anything: the night measures instead
        logger.warning("the plan of %s v%d was not measured ahead (%s): its first night measures it",
                       version.name, version.version, exc)  # fmt: skip
        return None
    if choice is not None:
        logger.info("execution plan of %s v%d, ready for its nights: %s", version.name, version.version, choice.reason)
    return choice
