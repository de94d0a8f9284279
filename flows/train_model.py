"""Flow ``train-model``: plan → prepare data → [tune] → train → evaluate → register and gate."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from rayline.flows.prepare_data import PrepareDataResult, PrepareRequest, prepare_data
from rayline.ray_workloads.training.evaluate import EvaluationResult
from rayline.ray_workloads.training.promotion import PromotionResult
from rayline.ray_workloads.training.request import TrainRequest
from rayline.ray_workloads.training.train import TrainResult
from rayline.ray_workloads.training.tune import TuneResult
from rayline.tasks.flow_lineage import openlineage_flow
from rayline.tasks.plans import measure_plan_task
from rayline.tasks.register import register_and_gate
from rayline.tasks.registry_lookups import reconcile_mirror_task
from rayline.tasks.train import evaluate_task, train_model_task
from rayline.tasks.training_plan import plan_training_task
from rayline.tasks.tune import tune_task


class TrainModelResult(BaseModel):
    data: PrepareDataResult
    tuned: TuneResult | None = None
    trained: TrainResult
    evaluation: EvaluationResult
    registration: PromotionResult


@openlineage_flow
@flow(name="train-model")
def train_model(request: TrainRequest = TrainRequest()) -> TrainModelResult:  # noqa: B008  # frozen: one default
    """Train a classifier on ``request.source_uri`` (default ``<storage>/raw``) and gate it into the registry.

    With ``tune_samples > 0`` an ASHA search runs first. A model that passes the gate becomes ``promote_to``:
    the first champion passes ``floor``; a later model must beat the champion on the same test images by
    ``margin`` and by an exact McNemar test at ``alpha``. A fine-tune (``init_from``, a fine-tuned champion, or
    ``labelled``) starts from the parent's weights and image spec, with a new head, and never searches:
    :func:`rayline.ray_workloads.training.plan.plan_training` decides, the flow runs its steps.
    """
    plan = plan_training_task(request)
    reconcile_mirror_task(plan.name)  # before anything can fail: completes a mirror an earlier run left unfinished
    # not announced as asking for a retraining: this run trains on it now
    data = prepare_data(PrepareRequest(source_uri=plan.source_uri, image=plan.image, announce_retrain=False))
    searched = tune_task(plan.search(data.preprocess), plan.loop) if plan.searches else None
    training = plan.training(data.preprocess, searched)
    trained = train_model_task(training, tracking_experiment=plan.name)
    evaluation = evaluate_task(training, trained, tracking_experiment=plan.name)
    gated = register_and_gate(plan.promotion(training, trained, evaluation))
    if gated.alias is not None:  # a version nights will run: its plan measured before the first one
        measure_plan_task(gated.version)
    _publish_summary(trained, evaluation, gated)
    return TrainModelResult(data=data, tuned=searched, trained=trained, evaluation=evaluation, registration=gated)


def _publish_summary(trained: TrainResult, evaluation: EvaluationResult, registration: PromotionResult) -> None:
    version, parent = registration.version, registration.version.parent
    started = f"{parent.name} v{parent.version}{' (head only)' if parent.freeze_backbone else ''}" if parent else "-"
    rows = {
        "model": f"{version.name} v{version.version}",
        "fine-tuned from": started,
        "test accuracy": f"{evaluation.accuracy:.4f}",
        "gate": registration.decision.reason,
        "champion": f"v{registration.champion}" if registration.champion else "none",
        "epochs": str(trained.epochs),
        "weights": version.weights_uri,
    }
    create_table_artifact(key="train-model-summary", table=[{"item": k, "value": v} for k, v in rows.items()])
