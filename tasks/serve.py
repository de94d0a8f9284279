"""Prefect tasks of a serve rollout: prepare, one traffic step, roll back, promote."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact

from rayline import events
from rayline.models import registry
from rayline.ray_workloads.registration import mlflow_models
from rayline.ray_workloads.serving import canary, rollout
from rayline.ray_workloads.serving.canary import PreparedRollout as PreparedRollout  # the type flows pass between tasks
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.storage.fencing import Fence
from rayline.tasks.common import emit, emit_alias_move, idempotency_key, ray_task, record_lineage


@ray_task("serve-prepare-rollout", timeout_s=900)
def prepare_rollout_task(
    candidate: registry.ModelVersion, serve: ServeConfig, fence: Fence | None = None
) -> PreparedRollout:
    """Serve the incumbent (the champion, after rolling back what an unfinished rollout left:
    ``canary.reconcile``) and the candidate at 0%; every traffic move carries ``fence``, the lease's token."""
    prepared = canary.prepare(candidate, serve, fence)
    if prepared.reconciled is not None:
        get_run_logger().warning("%s: %s", candidate.name, prepared.reconciled.describe())
    if prepared.needed:
        get_run_logger().info(
            "serving %s v%d at %s; candidate v%d deployed at 0%%",
            candidate.name,
            prepared.incumbent.version,
            prepared.base_url,
            candidate.version,
        )
    return prepared


@ray_task("serve-rollout-step", timeout_s=900)
def rollout_step_task(
    cfg: rollout.RolloutConfig,
    prepared: PreparedRollout,
    weight: float,
    incumbent_p95_ms: float | None,
    check_agreement: bool,
) -> rollout.StepReport:
    spec = prepared.incumbent.image_spec
    images = rollout.load_probe_images(cfg.probe_uri, cfg.probe_images, spec)
    report = rollout.run_step(
        cfg,
        prepared.base_url,
        prepared.incumbent.version,
        prepared.candidate.version,
        weight,
        images,
        incumbent_p95_ms,
        check_agreement,
        model=prepared.candidate.name,
        fence=prepared.fence,
    )
    verdict = "passed" if report.passed else "FAILED"
    get_run_logger().info("v%d at %g%%: %s — %s", prepared.candidate.version, weight, verdict, report.reason)
    return report


def _steps_table(steps: list[rollout.StepReport]) -> list[dict[str, Any]]:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value, 1)

    return [
        {
            "weight %": s.weight,
            "candidate requests": s.candidate.requests if s.candidate else 0,
            "candidate errors": s.candidate.errors if s.candidate else 0,
            "candidate p95 ms": ms(s.candidate.p95_ms) if s.candidate else None,
            "incumbent p95 ms": ms(s.incumbent_p95_ms),
            "agreement": None if s.agreement is None else round(s.agreement, 3),
            "verdict": ("passed: " if s.passed else "FAILED: ") + s.reason,
        }
        for s in steps
    ]


def _finish(outcome: canary.RolloutOutcome, event: str) -> None:
    """What every outcome records: an artifact with the steps, a lineage record, an event."""
    cand, inc = outcome.prepared.candidate, outcome.prepared.incumbent
    create_table_artifact(
        key="serve-rollout", table=_steps_table(outcome.steps), description=f"{outcome.outcome}: {outcome.reason}"
    )
    record_lineage("serve_rollout", outcome, parameters={"steps": [s.model_dump(mode="json") for s in outcome.steps]})
    emit(
        event,
        events.model_resource(cand.name, cand.version),
        payload={
            "model": cand.name,
            "candidate": cand.version,
            "incumbent": inc.version,
            "reason": outcome.reason,
            **outcome.details(),
        },
        idempotency_key=idempotency_key(outcome.outcome, cand.uri, inc.uri),  # a retried promote/roll-back: one event
    )


@ray_task("serve-roll-back", timeout_s=300)
def roll_back_task(prepared: PreparedRollout, steps: list[rollout.StepReport], reason: str, serve: ServeConfig) -> None:
    outcome = canary.roll_back(prepared, steps, reason, serve)
    get_run_logger().warning("rolled back v%d: %s", prepared.candidate.version, reason)
    _finish(outcome, events.ROLLED_BACK)


@ray_task("serve-promote", timeout_s=300)
def promote_task(
    prepared: PreparedRollout, steps: list[rollout.StepReport], serve: ServeConfig, rollout_holder: str
) -> registry.AliasMove:
    """Make the candidate champion (as the holder of the model's rollout lease) and retire the incumbent."""
    promotion = canary.promote(prepared, steps, serve, rollout_holder)
    cand = prepared.candidate
    mlflow_models.reconcile(cand.name)  # best effort: logged on failure, completed by the next call
    get_run_logger().info("v%d is champion; v%d retired from serving", cand.version, prepared.incumbent.version)
    _finish(promotion, events.PROMOTED)
    emit_alias_move(promotion.alias_move)
    return promotion.alias_move
