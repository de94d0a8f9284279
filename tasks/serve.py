"""Prefect tasks of a serve rollout: prepare, one traffic step, roll back, promote."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from ray_workloads.serving import rollout
from ray_workloads.serving.config import ServeConfig
from rayline import events, mlflow_mirror, ray_cluster, registry
from rayline.lineage import DatasetRef
from tasks.common import emit, idempotency_key, ray_task, record_lineage


class PreparedRollout(BaseModel):
    base_url: str
    incumbent: registry.ModelVersion
    candidate: registry.ModelVersion


@ray_task("serve-prepare-rollout", timeout_s=900)
def prepare_rollout_task(candidate: registry.ModelVersion, serve: ServeConfig) -> PreparedRollout:
    """Serve the incumbent (the model's live version with most traffic, else its champion) and the candidate at 0%."""
    ray_cluster.connect()
    base_url = rollout.start(serve)
    live = rollout.incumbent_version(serve, candidate.name)
    incumbent = registry.get_version(candidate.name, live) if live else registry.resolve(candidate.name, "champion")
    if incumbent.version == candidate.version:  # already done (e.g. a second trigger): nothing to roll out
        return PreparedRollout(base_url=base_url, incumbent=incumbent, candidate=candidate)
    base_url = rollout.prepare(incumbent, candidate, serve)
    get_run_logger().info(
        "serving %s v%d at %s; candidate v%d deployed at 0%%",
        candidate.name,
        incumbent.version,
        base_url,
        candidate.version,
    )
    return PreparedRollout(base_url=base_url, incumbent=incumbent, candidate=candidate)


@ray_task("serve-rollout-step", timeout_s=900)
def rollout_step_task(
    cfg: rollout.RolloutConfig,
    prepared: PreparedRollout,
    weight: float,
    incumbent_p95_ms: float | None,
    check_agreement: bool,
) -> rollout.StepReport:
    ray_cluster.connect()
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
    )
    get_run_logger().info(
        "v%d at %g%%: %s — %s",
        prepared.candidate.version,
        weight,
        "passed" if report.passed else "FAILED",
        report.reason,
    )
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


def _finish(
    stage: str,
    event: str,
    prepared: PreparedRollout,
    steps: list[rollout.StepReport],
    reason: str,
    extra: dict[str, Any],
    connection: ray_cluster.RayConnection,
    started: datetime,
) -> None:
    """What every outcome records: an artifact with the steps, a lineage record, an event."""
    cand, inc = prepared.candidate, prepared.incumbent
    create_table_artifact(key="serve-rollout", table=_steps_table(steps), description=f"{stage}: {reason}")
    record_lineage(
        stage="serve_rollout",
        started_at=started,
        inputs=[DatasetRef(uri=inc.uri), DatasetRef(uri=cand.uri)],
        outputs=[DatasetRef(uri=cand.uri, facets={"outcome": stage, "reason": reason, **extra})],
        parameters={"steps": [s.model_dump(mode="json") for s in steps]},
        connection=connection,
    )
    emit(
        event,
        events.model_resource(cand.name, cand.version),
        payload={"model": cand.name, "candidate": cand.version, "incumbent": inc.version, "reason": reason, **extra},
        idempotency_key=idempotency_key(stage, cand.uri, inc.uri),  # a retried promote/roll-back: one event
    )


@ray_task("serve-roll-back", timeout_s=300)
def roll_back_task(prepared: PreparedRollout, steps: list[rollout.StepReport], reason: str, serve: ServeConfig) -> None:
    started = datetime.now(UTC)
    connection = ray_cluster.connect()
    rollout.roll_back(prepared.incumbent.version, prepared.candidate.version, serve, model=prepared.candidate.name)
    get_run_logger().warning("rolled back v%d: %s", prepared.candidate.version, reason)
    _finish("rolled back", events.ROLLED_BACK, prepared, steps, reason, {}, connection, started)


@ray_task("serve-promote", timeout_s=300)
def promote_task(prepared: PreparedRollout, steps: list[rollout.StepReport], serve: ServeConfig) -> registry.AliasMove:
    started = datetime.now(UTC)
    connection = ray_cluster.connect()
    cand = prepared.candidate
    reason = f"canary rollout passed every step ({', '.join(f'{s.weight:g}%' for s in steps)})"
    move = registry.set_alias(cand.name, registry.CHAMPION, cand.version, reason)
    mlflow_mirror.reconcile(cand.name)  # best effort: logged on failure, completed by the next call
    rollout.retire(prepared.incumbent.version, cand.version, serve, model=cand.name)
    get_run_logger().info("v%d is champion; v%d retired from serving", cand.version, prepared.incumbent.version)
    _finish(
        "promoted",
        events.PROMOTED,
        prepared,
        steps,
        reason,
        {"alias_move": move.model_dump(mode="json")},
        connection,
        started,
    )
    return move
