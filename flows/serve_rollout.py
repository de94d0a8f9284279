"""Flow ``serve-rollout``: canary a candidate next to the serving version, promote or roll back."""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from ray_workloads.serving.config import ServeConfig, config_from_settings
from ray_workloads.serving.rollout import GateConfig, RolloutConfig, StepReport
from rayline.errors import LeaseLost, RolloutRolledBack
from rayline.leases import HeldLease
from rayline.registry import CHAMPION, ModelVersion
from tasks.models import alias_version_task, resolve_version_task
from tasks.rollouts import another_rollout_holds_task, probe_source_task, rollout_lease
from tasks.serve import PreparedRollout, prepare_rollout_task, promote_task, roll_back_task, rollout_step_task


class RolloutResult(BaseModel):
    model: str
    candidate: int
    incumbent: int
    promoted: bool
    reason: str
    steps: list[StepReport]


def serve_config() -> ServeConfig:
    """The serving instance of this environment (host, port and default model from settings)."""
    return config_from_settings()


@flow(name="serve-rollout")
def serve_rollout(
    candidate: str = "challenger",
    model_name: str = "digits",
    steps: list[float] | None = None,
    soak_s: float = 10.0,
    probe_rps: float = 20.0,
    probe_uri: str | None = None,
    max_error_rate: float = 0.01,
    max_p95_ratio: float = 1.5,
    min_agreement: float = 0.9,
    min_requests: int = 20,
    lease_wait_s: float = 1800.0,
) -> RolloutResult:
    """Step ``candidate`` (alias or version) through the traffic ``steps`` (default 10 → 50 → 100 %).

    Each step soaks for ``soak_s`` seconds with canary probes from ``probe_uri``
    (default: the candidate's training images, or an outside model's latest
    night's inputs) and is judged on error rate, p95 latency and — at the
    first step — agreement with the serving version. A failed gate rolls back
    and fails the flow with the reason; a full pass makes the candidate
    champion and retires the old version's deployment.
    """
    serve = serve_config()
    version = resolve_version_task(model_name, candidate)
    cfg = RolloutConfig(
        steps=steps or [10.0, 50.0, 100.0],
        soak_s=soak_s,
        probe_rps=probe_rps,
        probe_uri=probe_uri or probe_source_task(version),
        gates=GateConfig(
            max_error_rate=max_error_rate,
            max_p95_ratio=max_p95_ratio,
            min_agreement=min_agreement,
            min_requests=min_requests,
        ),
        serve=serve,
    )
    with rollout_lease(model_name, lease_wait_s) as lease:  # held across every task of the rollout, not in one
        result = _roll_out(cfg, version, serve, lease)
    if not result.steps and lease.waited_s > 1.0:  # say why there was nothing to do
        result.reason += f" (another rollout promoted it while this one waited {lease.waited_s:.0f} s for the lease)"
    return result


def _roll_out(cfg: RolloutConfig, version: ModelVersion, serve: ServeConfig, lease: HeldLease) -> RolloutResult:
    prepared = prepare_rollout_task(version, serve)
    if prepared.incumbent.version == prepared.candidate.version:
        return RolloutResult(
            model=version.name,
            candidate=version.version,
            incumbent=version.version,
            promoted=True,
            reason=f"v{version.version} already serves all traffic",
            steps=[],
        )
    reports: list[StepReport] = []
    promoting = False
    try:
        _step_through(cfg, prepared, reports, serve, lease)
        lease.ensure_held()  # a run that lost its lease (paused past its expiry) must not move the champion alias
        promoting = True
        promote_task(prepared, reports, serve)
    except RolloutRolledBack:
        raise  # rolled back already
    except LeaseLost:
        if another_rollout_holds_task(version.name, lease.lease.holder):
            raise  # that rollout owns serving now: nothing here to take back
        _roll_back_after_error(prepared, reports, "lost its lease", serve, promoting)
        raise
    except Exception as exc:
        # Not a failed gate: a step or the promotion raised. Left alone, the candidate would keep
        # its weight, the next rollout would take it for the incumbent, and serving and the
        # registry's champion would disagree.
        _roll_back_after_error(prepared, reports, f"raised {type(exc).__name__}: {exc}", serve, promoting)
        raise
    return RolloutResult(
        model=version.name,
        candidate=prepared.candidate.version,
        incumbent=prepared.incumbent.version,
        promoted=True,
        reason=f"v{prepared.candidate.version} passed {len(reports)} steps and is champion",
        steps=reports,
    )


def _step_through(
    cfg: RolloutConfig,
    prepared: PreparedRollout,
    reports: list[StepReport],
    serve: ServeConfig,
    lease: HeldLease,
) -> None:
    """Each traffic step in turn; a failed gate rolls back and raises ``RolloutRolledBack``."""
    baseline: float | None = None
    for weight in cfg.steps:
        lease.ensure_held()  # no traffic moves for a rollout that is no longer the model's one rollout
        report = rollout_step_task(cfg, prepared, weight, baseline, check_agreement=not reports)
        reports.append(report)
        baseline = report.incumbent_p95_ms
        if not report.passed:
            reason = f"v{prepared.candidate.version} failed the gate at {weight:g}%: {report.reason}"
            roll_back_task(prepared, reports, reason, serve)
            raise RolloutRolledBack(f"{reason}; all traffic is back on v{prepared.incumbent.version}")


def _roll_back_after_error(
    prepared: PreparedRollout, reports: list[StepReport], what: str, serve: ServeConfig, promoting: bool
) -> None:
    """All traffic back on the incumbent, unless this rollout's promotion already landed in the
    registry (then the candidate is champion and serving it is what agrees with the registry)."""
    cand = prepared.candidate
    if promoting and alias_version_task(cand.name, CHAMPION) == cand.version:
        return
    roll_back_task(prepared, reports, f"the rollout of v{cand.version} {what}", serve)
