"""Flow ``nightly-inference``: predict a night's arrivals with a registered version, commit it to the Delta tables.

Or each night of a range, several at once, each its own commit: a backfill after an outage or a new
champion (:mod:`rayline.flows.nightly_backfill`). What a run is asked is one :class:`NightRequest`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_link_artifact, create_table_artifact

from rayline.config import get_settings
from rayline.errors import ConfigError
from rayline.flows.nightly_backfill import check_error_budget, night_config, run_range
from rayline.models.registry import CHALLENGER, ModelVersion
from rayline.ray_workloads.execution.plan import plans_text
from rayline.ray_workloads.nightly.batch_inference import InferenceResult, NightSkipped
from rayline.ray_workloads.nightly.request import BackfillResult
from rayline.ray_workloads.nightly.request import NightRequest as NightRequest  # callers import it with the flow
from rayline.skipped import skipped_text
from rayline.tasks.batch_inference import batch_inference_task
from rayline.tasks.flow_lineage import openlineage_flow
from rayline.tasks.registry_lookups import (
    alias_version_task,
    parse_model_ref_task,
    requested_version,
    resolve_version_task,
)


def _shadow_version(version: ModelVersion, shadow: str | None) -> ModelVersion | None:
    """The version scored beside ``version``: ``shadow``'s, else the challenger when the settings ask, else none."""
    if shadow is not None:
        name, ref = parse_model_ref_task(shadow, version.name)
        if name != version.name:
            raise ConfigError(f"shadow {shadow!r} names {name!r}: a shadow is another version of {version.name!r}")
        return resolve_version_task(name, ref)
    if not get_settings().shadow_challenger:
        return None
    challenger = alias_version_task(version.name, CHALLENGER)
    if challenger is None or challenger == version.version:
        return None
    return resolve_version_task(version.name, challenger)


def _skipped(result: InferenceResult) -> str:
    """The listed objects that got no row, by reason, and the first keys of each: or 0."""
    if not result.skipped:
        return "0"
    return f"{skipped_text(result.skipped)}: e.g. {result.skipped_examples}"


@openlineage_flow
@flow(name="nightly-inference")
def nightly_inference(
    request: NightRequest = NightRequest(),  # noqa: B008  # frozen: one default instance is safe to share
) -> InferenceResult | NightSkipped | BackfillResult:
    """Predict the request's night (default: yesterday, UTC), or each night of its range, and commit it.

    A night fails, after committing, when more than ``max_error_fraction`` of its inputs failed, and ends
    Completed without committing (``NightSkipped``) when another run committed it meanwhile. A range fails
    naming its failed nights (the others stay committed), else returns a ``BackfillResult``.
    """
    version = requested_version(request.model, request.model_name)
    shadow = _shadow_version(version, request.shadow)
    if request.is_range:
        return run_range(request, version, shadow)
    (day,) = request.nights()
    result = batch_inference_task(night_config(request, day, version, shadow))
    if isinstance(result, NightSkipped):
        create_table_artifact(key="nightly-inference", table=[{"item": "skipped", "value": result.message}])
        return result
    _report(result)
    check_error_budget(result, request.max_error_fraction)
    return result


def _report(result: InferenceResult) -> None:
    """The night's summary and a link to its predictions table, as the run's artifacts."""
    summary: list[dict[str, Any]] = [
        {"item": "night", "value": result.night},
        {"item": "inputs", "value": result.inputs},
        {"item": "predictions", "value": result.predictions},
        {"item": "errors", "value": f"{result.errors} ({result.error_fraction:.2%}) {result.error_types}"},
        {"item": "skipped (not inputs)", "value": _skipped(result)},
        {"item": "rows/s", "value": round(result.inputs / max(result.elapsed_s, 1e-9), 1)},
        {"item": "CPU", "value": result.cost_text()},
        {"item": "model", "value": result.model},
        {"item": "execution plan", "value": plans_text(result.plans)},
        {"item": "predictions table", "value": f"{result.predictions_table} version {result.predictions_version}"},
        {"item": "errors table", "value": f"{result.errors_table} version {result.errors_version}"},
        {"item": "replaced an earlier run", "value": result.replaced},
        *([{"item": "shadow", "value": result.shadow.line()}] if result.shadow else []),
    ]
    create_table_artifact(key="nightly-inference", table=summary)
    create_link_artifact(
        key="nightly-inference-output",
        link=result.predictions_table,
        link_text=f"{result.night} (Delta version {result.predictions_version})",
    )
