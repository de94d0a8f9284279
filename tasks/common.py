"""What every rayline task shares: retry policy, run ids, lineage recording."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.runtime import flow_run, task_run

from rayline import lineage
from rayline.errors import is_transient
from rayline.lineage import DatasetRef, LineageRecord, RunContext
from rayline.ray_cluster import RayConnection

# Backoff for transient failures (S3 throttling/5xx, connection resets, lost
# Ray workers); jitter spreads retries of parallel runs.
RETRY_DELAYS_S: list[float] = [5.0, 20.0, 60.0]
RETRY_JITTER = 0.5
# Every task that waits on Ray gets a timeout: a starved cluster hangs silently.
DEFAULT_TIMEOUT_S = 3600


P = ParamSpec("P")
R = TypeVar("R")


def ray_task(name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Callable[[Callable[P, R]], Task[P, R]]:
    """The one retry/timeout/caching policy of every task that runs a Ray workload.

    No Prefect result caching: workloads skip committed outputs themselves
    (content-addressed folders, resumable runs), which also survives a lost
    Prefect database.
    """

    def decorate(fn: Callable[P, R]) -> Task[P, R]:
        return task(
            name=name,
            retries=len(RETRY_DELAYS_S),
            retry_delay_seconds=RETRY_DELAYS_S,
            retry_jitter_factor=RETRY_JITTER,
            retry_condition_fn=retry_if_transient,
            timeout_seconds=timeout_s,
            cache_policy=NO_CACHE,
            persist_result=False,
        )(fn)

    return decorate


def retry_if_transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect retry condition: retry only errors that a retry can fix."""
    try:
        state.result()
    except Exception as exc:
        return is_transient(exc)
    return False


def run_context(connection: RayConnection | None) -> RunContext:
    """Prefect and Ray identifiers of the current run, for lineage."""
    return RunContext(
        flow_run_id=_str_or_none(flow_run.get_id()),
        flow_name=_str_or_none(flow_run.get_flow_name()),
        task_run_id=_str_or_none(task_run.get_id()),
        task_name=_str_or_none(task_run.get_task_name()),
        ray_job_id=connection.job_id if connection else None,
        ray_address=connection.address if connection else None,
    )


def record_lineage(
    stage: str,
    started_at: datetime,
    inputs: list[DatasetRef],
    outputs: list[DatasetRef],
    parameters: dict[str, Any],
    connection: RayConnection | None,
    cached: bool = False,
) -> str:
    """Write this stage run's lineage record; returns its URI."""
    record = LineageRecord(
        stage=stage,
        started_at=started_at,
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        code_version=lineage.code_version(),
        run=run_context(connection),
        cached=cached,
    )
    return lineage.write_record(record)


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)
