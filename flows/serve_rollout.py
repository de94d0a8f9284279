"""Flow ``serve-rollout``: canary a candidate next to the serving version, promote or roll back."""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from rayline.config import labelled_win_required
from rayline.errors import AliasConflict, LeaseLost, QualityGateFailed, RolloutRolledBack
from rayline.models.registry import CHAMPION, ModelVersion
from rayline.ray_workloads.quality.paired import PairedTest
from rayline.ray_workloads.serving.config import ServeConfig, config_from_settings
from rayline.ray_workloads.serving.request import RolloutRequest as RolloutRequest  # callers import it with the flow
from rayline.ray_workloads.serving.rollout import RolloutConfig, StepReport
from rayline.storage.layout import root_uri
from rayline.storage.leases import HeldLease
from rayline.tasks.flow_lineage import openlineage_flow
from rayline.tasks.labels import labelled_gate_task
from rayline.tasks.registry_lookups import alias_version_task, requested_version
from rayline.tasks.rollouts import another_rollout_holds_task, probe_source_task, rollout_lease
from rayline.tasks.serve import PreparedRollout, prepare_rollout_task, promote_task, roll_back_task, rollout_step_task


class RolloutResult(BaseModel):
    model: str
    candidate: int
    incumbent: int
    promoted: bool
    reason: str
    steps: list[StepReport]
    reconciled: str | None = None  # what a rollout that did not finish left, and that it was rolled back
    labelled: PairedTest | None = None  # the labelled paired test, when the rollout required a labelled win


def serve_config() -> ServeConfig:
    """The serving instance of this environment (host, port and default model from settings)."""
    return config_from_settings()


@openlineage_flow
@flow(name="serve-rollout")
def serve_rollout(request: RolloutRequest = RolloutRequest()) -> RolloutResult:  # noqa: B008  # frozen: one default
    """Step the request's candidate through its traffic steps (default 10 → 50 → 100 %).

    First, weights an unfinished rollout left on versions other than the champion go back to it (the
    result's ``reconciled``). Each step soaks with canary probes, judged on error rate, p95 latency and, at
    the first step, agreement with the serving version. A failed gate rolls back and fails the flow; a full
    pass makes the candidate champion. One rollout per model at a time: a second waits for the lease (a
    dead rollout's is taken over ``lease_ttl_s`` after its last renewal).

    With ``require_labelled_win``, the labels must first say the candidate beats the champion it would
    replace (the paired test, docs/quality.md): inconclusive moves no traffic (``promoted`` false); failed
    raises ``QualityGateFailed``.
    """
    serve = serve_config()
    version = requested_version(request.candidate, request.model_name)
    # held across every task of the rollout: the labels judge against the champion the promotion moves from
    with rollout_lease(version.name, request.lease_wait_s, request.lease_ttl_s) as lease:
        labelled = _labelled_win(version, request.require_labelled_win)
        if labelled is not None and labelled.outcome != "passed":
            return _waits_for_labels(version, labelled)
        cfg = request.config(request.probe_uri or probe_source_task(version), serve)
        result = _roll_out(cfg, version, serve, lease, labelled)
    if not result.steps and lease.waited_s > 1.0:  # say why there was nothing to do
        result.reason += f" (another rollout promoted it while this one waited {lease.waited_s:.0f} s for the lease)"
    return result


def _result(
    version: ModelVersion, incumbent: int, promoted: bool, reason: str, steps: list[StepReport] | None = None
) -> RolloutResult:
    return RolloutResult(
        model=version.name,
        candidate=version.version,
        incumbent=incumbent,
        promoted=promoted,
        reason=reason,
        steps=steps or [],
    )


def _waits_for_labels(version: ModelVersion, labelled: PairedTest) -> RolloutResult:
    reason = f"v{version.version} waits for more labels before its rollout: {labelled.describe()}"
    return _result(version, labelled.champion, False, reason).model_copy(update={"labelled": labelled})


def _labelled_win(version: ModelVersion, asked: bool | None, champion: int | None = None) -> PairedTest | None:
    """The labelled paired test of ``version`` against the champion (``champion``, else the one now), when a win
    is required (and there is a champion other than it); raises ``QualityGateFailed`` when the labels say it
    is worse. Asked under the rollout lease."""
    if not labelled_win_required(asked):
        return None
    if champion is None:
        champion = alias_version_task(version.name, CHAMPION)
    if champion is None or champion == version.version:
        return None
    test = labelled_gate_task(root_uri(), version.name, champion, version.version)
    if test.outcome == "failed":
        raise QualityGateFailed(f"{version.name} v{version.version} is not rolled out: {test.describe()}")
    return test


def _roll_out(
    cfg: RolloutConfig, version: ModelVersion, serve: ServeConfig, lease: HeldLease, labelled: PairedTest | None
) -> RolloutResult:
    # every traffic move carries the lease's fencing token: refused once a rollout that took over moved traffic
    prepared = prepare_rollout_task(version, serve, lease.fencing_token())
    if labelled is not None and prepared.champion != labelled.champion:
        # the promotion moves from the champion prepare read: the labels must have judged against that one
        labelled = _judged_again(prepared, serve)
        if labelled is not None and labelled.outcome != "passed":
            return _waits_for_labels(version, labelled)
    result = _roll_out_prepared(cfg, prepared, serve, lease)
    result.labelled = labelled
    if prepared.reconciled is not None:
        result.reconciled = prepared.reconciled.describe()
    return result


def _judged_again(prepared: PreparedRollout, serve: ServeConfig) -> PairedTest | None:
    """The labels' test against the champion prepared against; the candidate's deployment goes unless it passes."""
    try:
        test = _labelled_win(prepared.candidate, True, prepared.champion)
    except QualityGateFailed:
        roll_back_task(prepared, [], "the labels say it is worse than the champion it would replace", serve)
        raise
    if test is not None and test.outcome != "passed":
        roll_back_task(prepared, [], "it waits for more labels against the champion it would replace", serve)
    return test


def _roll_out_prepared(
    cfg: RolloutConfig, prepared: PreparedRollout, serve: ServeConfig, lease: HeldLease
) -> RolloutResult:
    version = prepared.candidate
    if not prepared.needed:  # the champion serves all traffic (prepare reconciled any other weights)
        return _result(version, version.version, True, f"v{version.version} already serves all traffic")
    reports: list[StepReport] = []
    promoting = False
    try:
        _step_through(cfg, prepared, reports, serve, lease)
        lease.ensure_held()  # a run that lost its lease (paused past its expiry) must not move the champion alias
        promoting = True
        promote_task(prepared, reports, serve, lease.lease.holder)
    except RolloutRolledBack:
        raise  # rolled back already
    except AliasConflict as exc:
        if promoting:
            # the champion moved: this rollout's lease lapsed and serving is another writer's now; a roll
            # back under the stale fence would be refused, or undo the other's move
            raise LeaseLost(
                f"the rollout of v{version.version} lost the champion to another writer before its move: {exc}; "
                "serving and the champion are left as that writer set them"
            ) from exc
        _roll_back_after_error(prepared, reports, f"raised AliasConflict: {exc}", serve, promoting)
        raise
    except LeaseLost:
        if another_rollout_holds_task(version.name, lease.lease.holder):
            raise  # that rollout owns serving now: nothing here to take back
        _roll_back_after_error(prepared, reports, "lost its lease", serve, promoting)
        raise
    except Exception as exc:  # whatever raised, serving must not be left half-rolled
        # left alone, the candidate would keep its weight and serving and the registry would disagree
        _roll_back_after_error(prepared, reports, f"raised {type(exc).__name__}: {exc}", serve, promoting)
        raise
    reason = f"v{version.version} passed {len(reports)} steps and is champion"
    return _result(version, prepared.incumbent.version, True, reason, reports)


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
    """All traffic back on the incumbent, unless this rollout's promotion landed (serving the candidate agrees)."""
    cand = prepared.candidate
    if promoting and alias_version_task(cand.name, CHAMPION) == cand.version:
        return
    roll_back_task(prepared, reports, f"the rollout of v{cand.version} {what}", serve)
