"""Prefect task: a ``train-model`` run's plan (``rayline.ray_workloads.training.plan``), made in the flow run:
it reads the registry and a manifest, which flows reach only through tasks, and may export the labels first.
"""

from __future__ import annotations

from prefect import get_run_logger

from rayline.ray_workloads.quality import training_set
from rayline.ray_workloads.training.plan import TrainingPlan, labelled_export, plan_training
from rayline.ray_workloads.training.request import TrainRequest
from rayline.tasks.common import io_task, lease_holder, record_lineage


@io_task("plan-training")
def plan_training_task(request: TrainRequest) -> TrainingPlan:
    """:func:`plan_training` as this flow run: its reads get the retry policy, its skipped search is logged.
    The labels export holds the folder's lease as this flow run: a retry re-enters it, another run waits."""
    exported = None
    if request.labelled:
        cfg = labelled_export(request)
        exported = training_set.run(cfg.model_copy(update={"holder": lease_holder()}))
        record_lineage("export-labelled", exported, parameters={"model_name": cfg.model_name})
    plan = plan_training(request, exported)
    if plan.note:
        get_run_logger().info(plan.note)
    return plan
