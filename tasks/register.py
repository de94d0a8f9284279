"""Prefect task: register a trained model and run the promotion gate (``rayline.ray_workloads.training.promotion``)."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from rayline import lineage
from rayline.ray_workloads.registration import mlflow_models
from rayline.ray_workloads.training import promotion
from rayline.tasks.common import emit_alias_move, idempotency_key, ray_task, record_lineage, run_context


@ray_task("register-and-gate")
def register_and_gate(cfg: promotion.PromotionConfig) -> promotion.PromotionResult:
    """Register and gate the weights (:func:`promotion.run`) as this flow run's: a retry registers nothing new."""
    key = idempotency_key(cfg.name, cfg.trained.weights_uri, cfg.evaluation.data_manifest_uri)
    run = {"code_version": lineage.code_version(), "flow_run_id": run_context().flow_run_id, "idempotency_key": key}
    gated = promotion.run(cfg.model_copy(update=run))
    name, version, decision, alias = cfg.name, gated.version, gated.decision, gated.alias
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
    gate = cfg.model_dump(include={"name", "margin", "floor", "alpha"})
    record_lineage("registry", gated, parameters={**gate, "metric": promotion.GATE_METRIC})
    return gated
