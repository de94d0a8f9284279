"""The per-night pieces of ``nightly-inference``, and its run of a range of nights (a backfill).

Not a flow: a helper module of the flows layer, which ``flows/nightly_inference.py``
imports (a flow imports no other flow, but a module that defines none it may).

Both paths build a night's config and judge its error budget here. A range
submits one ``batch-inference`` task per night, at most
``max_concurrent_nights`` at a time: each night is its own Delta commit and
its own task run, and a night that fails (any exception, or over its error
budget) leaves the others running. The run ends with one table artifact row
per night, then raises :class:`~rayline.errors.NightsFailed` if any night
failed, so the flow run ends Failed naming them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run

from rayline.config import get_settings
from rayline.errors import ErrorBudgetExceeded, NightsFailed
from rayline.lineage import code_version
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.execution.plan import PlanPolicy
from rayline.ray_workloads.nightly.batch_inference import InferenceConfig, InferenceResult, NightSkipped
from rayline.storage.layout import root_uri
from rayline.tables import night_ranges
from rayline.tables.night_ranges import BackfillResult, NightOutcome
from rayline.tasks.batch_inference import batch_inference_task, cluster_cpus

BACKFILL_ARTIFACT = "nightly-inference-backfill"

NightValue = InferenceResult | NightSkipped


def flow_run_id() -> str | None:
    run_id = flow_run.get_id()
    return str(run_id) if run_id else None


def night_config(
    day: date,
    version: ModelVersion,
    input_uri: str | None,
    actors: int,
    batch_size: int,
    plan: PlanPolicy | None = None,
    shadow: ModelVersion | None = None,
) -> InferenceConfig:
    """One night's workload config: the night's arrivals through ``version`` (and ``shadow``, scored beside it),
    committed under the storage root."""
    root = root_uri()
    return InferenceConfig(
        input_uri=night_ranges.night_input_uri(input_uri, root, day),
        tables_root=root,
        dt=day.isoformat(),
        model=version,
        shadow=shadow,
        actors=actors,
        batch_size=batch_size,
        io_concurrency=get_settings().io_concurrency,
        code_version=code_version(),
        flow_run_id=flow_run_id(),
        plan=plan or PlanPolicy(),
    )


def check_error_budget(result: InferenceResult, max_error_fraction: float) -> None:
    """Refuse a committed night whose share of failed inputs is over budget (its errors are in the table)."""
    if result.error_fraction > max_error_fraction:
        raise ErrorBudgetExceeded(
            f"{result.errors} of {result.inputs} inputs failed ({result.error_fraction:.1%}, budget "
            f"{max_error_fraction:.1%}); see the errors table: {result.errors_table} version {result.errors_version}, "
            f"model_name = '{result.model_name}' AND dt = '{result.dt}'"
        )


def night_outcome(dt: str, value: NightValue | Exception, max_error_fraction: float) -> NightOutcome:
    """What became of one night of a range, from what its task returned or raised."""
    if isinstance(value, Exception):
        return NightOutcome(dt=dt, state="failed", message=f"{type(value).__name__}: {value}")
    if isinstance(value, NightSkipped):
        return NightOutcome(dt=dt, state="skipped", message=value.message)
    counts: dict[str, Any] = {
        "inputs": value.inputs,
        "predictions": value.predictions,
        "errors": value.errors,
        "skipped_objects": value.skipped,
        "predictions_version": value.predictions_version,
        "errors_version": value.errors_version,
    }
    try:
        check_error_budget(value, max_error_fraction)
    except ErrorBudgetExceeded as exc:  # committed, yet failed: the budget is judged per night
        return NightOutcome(dt=dt, state="failed", message=f"{type(exc).__name__}: {exc}", **counts)
    return NightOutcome(
        dt=dt, state="committed", message="replaced an earlier commit" if value.replaced else "", **counts
    )


def _settle(future: PrefectFuture[NightValue]) -> NightValue | Exception:
    try:
        return future.result()
    except Exception as exc:  # one night's failure is that night's outcome, not the run's
        return exc


def _run_nights(configs: Sequence[InferenceConfig], width: int) -> dict[str, NightValue | Exception]:
    """Every night's task, at most ``width`` running at once; what each returned or raised, by dt."""
    logger = get_run_logger()
    settled: dict[str, NightValue | Exception] = {}
    running: dict[PrefectFuture[NightValue], str] = {}

    def settle_one() -> None:
        done = as_completed(list(running))
        future = next(done)
        done.close()
        dt = running.pop(future)
        settled[dt] = _settle(future)
        logger.info("night %s: %s", dt, type(settled[dt]).__name__)

    for config in configs:
        if len(running) >= width:
            settle_one()
        running[batch_inference_task.submit(config)] = config.dt
    while running:
        settle_one()
    return settled


def run_range(
    days: Sequence[date],
    version: ModelVersion,
    *,
    input_uri: str | None,
    actors: int,
    batch_size: int,
    max_error_fraction: float,
    max_concurrent_nights: int | None,
    plan: PlanPolicy | None = None,
    shadow: ModelVersion | None = None,
) -> BackfillResult:
    """Run every night of ``days``; a table artifact row per night; raise NightsFailed if any failed."""
    configs = [night_config(day, version, input_uri, actors, batch_size, plan, shadow) for day in days]
    width = max_concurrent_nights or night_ranges.nights_at_once(
        cluster_cpus(), actors, configs[0].cpus_per_actor, len(configs)
    )
    get_run_logger().info("%d nights of %s v%d, %d at a time", len(configs), version.name, version.version, width)
    settled = _run_nights(configs, width)
    result = BackfillResult(
        model_name=version.name,
        model=f"{version.name} v{version.version}",
        date_from=days[0].isoformat(),
        date_to=days[-1].isoformat(),
        max_concurrent_nights=width,
        nights=[night_outcome(c.dt, settled[c.dt], max_error_fraction) for c in configs],
    )
    create_table_artifact(
        key=BACKFILL_ARTIFACT,
        table=[night.model_dump() for night in result.nights],
        description=f"{result.model}, {result.date_from} to {result.date_to}, {width} nights at a time",
    )
    if result.failed:
        raise NightsFailed(night_ranges.failure_message(result), result)
    return result
