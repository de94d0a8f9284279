"""OpenLineage runs of flow runs: every rayline flow is decorated with :func:`openlineage_flow`.

A flow run is the parent its tasks' events name (``rayline.tasks.common.openlineage_run``); its own parent is
the flow run that called it (a subflow), or the schedule or trigger of the deployment that created it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar
from uuid import UUID

from prefect import Flow, get_client
from prefect.client.schemas.objects import FlowRun, State

from rayline.lineage import openlineage_events
from rayline.tasks.common import warn_in_run

F = TypeVar("F", bound=Flow[Any, Any])

# the identity each running flow run's START named, for its end's events (hooks run in the flow run's process)
_running: dict[UUID, openlineage_events.RunIdentity] = {}


def openlineage_flow(flow: F) -> F:
    """Make each run of ``flow`` an OpenLineage run of its own (job: the flow's name, run id: the flow run's), the
    parent its tasks' events name: START when it runs, then COMPLETE, FAIL or ABORT. Prefect's state hooks emit
    them, so a run served by a deployment, called as a subflow or called directly is one alike."""
    flow.on_running(_flow_started)
    for ended in (flow.on_completion, flow.on_failure, flow.on_crashed, flow.on_cancellation):
        ended(_flow_ended)
    return flow


def _flow_identity(flow: Flow[Any, Any], run: FlowRun) -> openlineage_events.RunIdentity:
    """The flow run's identity; its parent the calling flow run (a subflow), else the deployment's schedule or
    trigger that created it (emitted here first: a parent a consumer can draw has events of its own)."""
    plain = openlineage_events.RunIdentity(run_id=str(run.id), job_name=flow.name, job_type="FLOW")
    try:
        with get_client(sync_client=True) as client:
            if run.parent_task_run_id is not None:
                caller = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)  # type: ignore[arg-type]
                parent_name = client.read_flow(caller.flow_id).name
                return dataclasses.replace(plain, parent_run_id=str(caller.id), parent_job_name=parent_name)
            if run.deployment_id is None or run.created_by is None:
                return plain
            deployment = client.read_deployment(run.deployment_id).name
    except Exception as exc:  # the API unreachable: the run's events stand without their parent
        warn_in_run("lineage: the parent of flow run %s not read: %s: %s", run.id, type(exc).__name__, exc)
        return plain
    made_by = run.created_by
    trigger = openlineage_events.trigger_run(
        made_by.type,
        str(made_by.id) if made_by.id else None,
        made_by.display_value,
        f"{flow.name}/{deployment}",
        str(run.id),
        scheduled_slot=run.idempotency_key,
        nominal_time=run.expected_start_time,
    )
    if trigger is None:
        return plain
    for state in ("START", "COMPLETE"):  # the schedule's tick or the automation's firing: it made this run
        openlineage_events.emit(state, trigger)
    return dataclasses.replace(plain, parent_run_id=trigger.run_id, parent_job_name=trigger.job_name)


def _flow_started(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    identity = _flow_identity(flow, flow_run)
    _running[flow_run.id] = identity
    openlineage_events.emit("START", identity)


def _flow_ended(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """COMPLETE, FAIL (failed or crashed, with Prefect's message) or ABORT (cancelled), parented as START was."""
    plain = openlineage_events.RunIdentity(run_id=str(flow_run.id), job_name=flow.name, job_type="FLOW")
    identity = _running.pop(flow_run.id, plain)
    if state.is_completed():
        openlineage_events.emit("COMPLETE", identity)
        return
    ended: openlineage_events.State = "FAIL" if state.is_failed() or state.is_crashed() else "ABORT"
    openlineage_events.emit(ended, identity, error=state.message or state.name or ended)
