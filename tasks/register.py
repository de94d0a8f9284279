"""Prefect task: register a trained model and run the promotion gate (``rayline.ray_workloads.training.promotion``)."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from rayline import lineage
from rayline.models import registry
from rayline.ray_workloads.architectures.build import ModelSpec
from rayline.ray_workloads.registration import mlflow_models
from rayline.ray_workloads.training import evaluate, promotion
from rayline.ray_workloads.training.train import TrainResult
from rayline.specs import ParentModel
from rayline.tasks.common import emit_alias_move, idempotency_key, ray_task, record_lineage, run_context


class RegistrationResult(BaseModel):
    version: registry.ModelVersion
    decision: registry.GateDecision
    champion: int | None
    alias: str | None = None  # the alias the candidate got, if it passed the gate


@ray_task("register-and-gate")
def register_and_gate(
    name: str,
    spec: ModelSpec,
    trained: TrainResult,
    evaluation: evaluate.EvaluationResult,
    margin: float = 0.0,
    floor: float = 0.9,
    alpha: float = registry.GATE_ALPHA,
    promote_to: str = registry.CHAMPION,
    parent: ParentModel | None = None,
    labelled_root: str | None = None,
    trained_on_labels: registry.TrainingLabels | None = None,
) -> RegistrationResult:
    """Register the trained weights and gate them.

    A later candidate passes when it beats the champion on the same test images by ``margin`` in accuracy
    and by an exact McNemar test at ``alpha`` (:func:`rayline.models.registry.gate`).
    A candidate that passes becomes ``promote_to``: ``champion`` directly, or
    ``challenger`` when serving decides (a canary rollout moves the champion
    later). The first model that passes the floor is champion either way.
    ``parent``: the version a fine-tune started from (kept on the version and
    named among the lineage record's inputs). ``labelled_root``: the champion
    moves only on a labelled win (``promotion.PromotionConfig.labelled_root``). ``trained_on_labels``: the
    labels imports a training on the labels learned from (they never judge the version).
    """
    key = idempotency_key(name, trained.weights_uri, evaluation.data_manifest_uri)
    gated = promotion.run(
        promotion.PromotionConfig(
            name=name,
            spec=spec,
            trained=trained,
            evaluation=evaluation,
            margin=margin,
            floor=floor,
            alpha=alpha,
            promote_to=promote_to,
            parent=parent,
            code_version=lineage.code_version(),
            flow_run_id=run_context().flow_run_id,
            idempotency_key=key,
            labelled_root=labelled_root,
            trained_on_labels=trained_on_labels,
        )
    )
    version, decision, alias = gated.version, gated.decision, gated.alias
    for move in gated.moves:  # a challenger is canaried: the serve-rollout deployment listens
        emit_alias_move(move)
    get_run_logger().info("registered %s v%d; gate: %s", name, version.version, decision.reason)
    mlflow_models.reconcile(name)  # best effort: a failure is logged, and the next registration catches up
    create_markdown_artifact(
        key="model-gate",
        markdown=(
            f"### {name} v{version.version}: {f'passed, now {alias}' if alias else 'not promoted'}\n\n"
            f"{decision.reason}\n\nweights `{version.weights_uri}`"
        ),
    )
    record_lineage(
        "registry",
        gated,
        parameters={
            "name": name,
            "margin": margin,
            "floor": floor,
            "alpha": alpha,
            "metric": promotion.GATE_METRIC,
        },
    )
    return RegistrationResult(version=version, decision=decision, champion=gated.champion, alias=alias)
