"""The per-night pieces of ``nightly-inference``, and its run of a range of nights (a backfill).

Not a flow (a flow imports no other flow). A range submits one ``batch-inference`` task per night, at most
``max_concurrent_nights`` at a time: each night is its own commit, and a night that fails leaves the others
running. The run ends with a table artifact row per night, then raises :class:`~rayline.errors.NightsFailed`
if any night failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run

from rayline.config import get_settings
from rayline.errors import ErrorBudgetExceeded, NightsFailed
from rayline.lineage import code_version
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.nightly.batch_inference import InferenceConfig, InferenceResult, NightSkipped
from rayline.ray_workloads.nightly.request import BackfillResult, NightOutcome, NightRequest
from rayline.storage.layout import root_uri
from rayline.tasks.batch_inference import batch_inference_task, cluster_cpus_task

BACKFILL_ARTIFACT = "nightly-inference-backfill"

NightValue = InferenceResult | NightSkipped


def night_config(request: NightRequest, day: date, model: ModelVersion, shadow: ModelVersion | None) -> InferenceConfig:
    """One night's workload config: its arrivals through ``model`` (and ``shadow`` beside it), committed."""
    run_id = flow_run.get_id()
    return InferenceConfig(
        input_uri=request.input_for(day, root_uri()),
        tables_root=root_uri(),
        dt=day.isoformat(),
        model=model,
        shadow=shadow,
        plan=request.plan,
        max_error_fraction=request.max_error_fraction,
        io_concurrency=get_settings().io_concurrency,
        code_version=code_version(),
        flow_run_id=str(run_id) if run_id else None,
        **request.shape.model_dump(),
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
    counts = value.model_dump(include={"inputs", "predictions", "errors", "predictions_version", "errors_version"})
    counts["skipped_objects"] = value.skipped
    try:
        check_error_budget(value, max_error_fraction)
    except ErrorBudgetExceeded as exc:  # committed, yet failed: the budget is judged per night
        return NightOutcome(dt=dt, state="failed", message=f"{type(exc).__name__}: {exc}", **counts)
    replaced = "replaced an earlier commit" if value.replaced else ""
    return NightOutcome(dt=dt, state="committed", message=replaced, **counts)


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
        try:
            settled[dt] = future.result()
        except Exception as exc:  # one night's failure is that night's outcome, not the run's
            settled[dt] = exc
        logger.info("night %s: %s", dt, type(settled[dt]).__name__)

    for config in configs:
        if len(running) >= width:
            settle_one()
        running[batch_inference_task.submit(config)] = config.dt
    while running:
        settle_one()
    return settled


def run_range(request: NightRequest, version: ModelVersion, shadow: ModelVersion | None) -> BackfillResult:
    """Run every night of the request's range; a table artifact row per night; raise NightsFailed if any failed."""
    configs = [night_config(request, day, version, shadow) for day in request.nights()]
    width = request.max_concurrent_nights or request.shape.nights_at_once(cluster_cpus_task(), len(configs))
    get_run_logger().info("%d nights of %s v%d, %d at a time", len(configs), version.name, version.version, width)
    settled = _run_nights(configs, width)
    result = BackfillResult(
        model_name=version.name,
        model=f"{version.name} v{version.version}",
        date_from=configs[0].dt,
        date_to=configs[-1].dt,
        max_concurrent_nights=width,
        nights=[night_outcome(c.dt, settled[c.dt], request.max_error_fraction) for c in configs],
    )
    create_table_artifact(
        key=BACKFILL_ARTIFACT,
        table=[night.model_dump() for night in result.nights],
        description=f"{result.model}, {result.date_from} to {result.date_to}, {width} nights at a time",
    )
    if result.failed:
        raise NightsFailed(result.failure_message(), result)
    return result
