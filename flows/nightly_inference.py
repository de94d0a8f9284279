"""Flow ``nightly-inference``: predict one day's arrivals with the champion, commit the night to Delta tables.

Or a range of nights (``date_from``..``date_to``), several at once, each its
own commit: a backfill after an outage or a new champion
(:mod:`rayline.flows.nightly_backfill`).
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_link_artifact, create_table_artifact

from rayline.config import get_settings
from rayline.errors import ConfigError
from rayline.flows.nightly_backfill import check_error_budget, night_config, run_range
from rayline.models.registry import CHALLENGER, ModelVersion
from rayline.ray_workloads.execution.plan import PlanPolicy, Precision, plans_text
from rayline.ray_workloads.nightly.batch_inference import InferenceResult, NightSkipped
from rayline.skipped import skipped_text
from rayline.storage.layout import model_name as checked_model_name
from rayline.storage.layout import parse_day, yesterday_utc
from rayline.tables import night_ranges
from rayline.tables.night_ranges import BackfillResult
from rayline.tasks.batch_inference import batch_inference_task
from rayline.tasks.registry_lookups import alias_version_task, parse_model_ref_task, resolve_version_task


def _shadow_version(version: ModelVersion, shadow: str | None) -> ModelVersion | None:
    """The version to score beside ``version``: the one ``shadow`` names, else the challenger when the
    settings ask for it and there is one other than ``version``, else none."""
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


@flow(name="nightly-inference")
def nightly_inference(
    date: str | None = None,
    model: str = "champion",
    model_name: str = "digits",
    input_uri: str | None = None,
    max_error_fraction: float = 0.05,
    actors: int = 2,
    batch_size: int = 64,
    date_from: str | None = None,
    date_to: str | None = None,
    max_concurrent_nights: int | None = None,
    plan: Literal["auto", "off"] = "auto",
    precision: Precision | None = None,
    backend: Literal["eager", "openvino"] | None = None,
    min_plan_agreement: float = 0.995,
    shadow: str | None = None,
) -> InferenceResult | NightSkipped | BackfillResult:
    """Predict every object under ``incoming/dt=<date>/`` (default: yesterday, UTC) with ``model_name``.

    ``model`` is an alias (``champion``) or a version (``v3``) of
    ``model_name``. The night replaces partition (``model_name``, ``dt``) of
    the ``predictions`` and ``prediction_errors`` Delta tables. Fails, after
    committing both, when more than ``max_error_fraction`` of the inputs
    could not be predicted. Ends Completed without committing when another
    run committed the same night while this one worked (``NightSkipped``).

    ``date_from`` and ``date_to`` (inclusive, instead of ``date``) run a range
    of nights with the version ``model`` names when the run starts,
    ``max_concurrent_nights`` at a time (default: as many as the cluster has
    CPUs for, see :func:`rayline.tables.night_ranges.nights_at_once`). Each night commits
    on its own and is judged against the error budget on its own; the run
    returns a ``BackfillResult`` when every night committed or was skipped,
    and fails naming the failed nights otherwise (the others stay committed).
    ``input_uri`` for a range needs ``{dt}`` where the day goes.

    ``plan`` ``auto`` lets each predictor measure the execution plans its
    machine offers (reduced precision where the hardware computes it
    natively) and use the fastest whose answers agree with fp32's on the
    night's first images (top-1 agreement at least ``min_plan_agreement``);
    ``precision``/``backend`` pin one (still gated); ``off`` runs fp32 eager.
    See :mod:`rayline.ray_workloads.execution.plan`.

    ``shadow`` (an alias such as ``challenger``, or a version such as ``v3``)
    scores a second version of ``model_name`` on the same decoded images, its
    rows in the ``shadow_predictions`` table, with the night's agreement
    between the two (``RAYLINE_SHADOW_CHALLENGER=1``: the challenger, whenever
    there is one). The night's rows, commits and error budget stay the
    champion's.
    """
    policy = PlanPolicy(mode=plan, precision=precision, backend=backend, min_agreement=min_plan_agreement)
    days = night_ranges.night_range(date, date_from, date_to)
    if days is not None:
        night_ranges.check_range_input(input_uri)
        if max_concurrent_nights is not None and max_concurrent_nights < 1:
            raise ConfigError(f"max_concurrent_nights must be at least 1, got {max_concurrent_nights}")
    day = parse_day(date) if date else yesterday_utc()
    name, ref = parse_model_ref_task(model, model_name)
    if name != model_name:  # the parameters stay explicit: a NAME@ref is the CLI's shorthand only
        raise ConfigError(
            f"model {model!r} names {name!r} but model_name is {model_name!r}: give the alias or version alone in model"
        )
    version = resolve_version_task(checked_model_name(name), ref)
    shadowed = _shadow_version(version, shadow)
    if days is not None:
        return run_range(
            days,
            version,
            input_uri=input_uri,
            actors=actors,
            batch_size=batch_size,
            max_error_fraction=max_error_fraction,
            max_concurrent_nights=max_concurrent_nights,
            plan=policy,
            shadow=shadowed,
        )
    result = batch_inference_task(night_config(day, version, input_uri, actors, batch_size, policy, shadowed))
    if isinstance(result, NightSkipped):
        create_table_artifact(key="nightly-inference", table=[{"item": "skipped", "value": result.message}])
        return result
    summary: list[dict[str, Any]] = [
        {"item": "night", "value": result.night},
        {"item": "inputs", "value": result.inputs},
        {"item": "predictions", "value": result.predictions},
        {"item": "errors", "value": f"{result.errors} ({result.error_fraction:.2%}) {result.error_types}"},
        {"item": "skipped (not inputs)", "value": _skipped(result)},
        {"item": "rows/s", "value": round(result.inputs / max(result.elapsed_s, 1e-9), 1)},
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
    check_error_budget(result, max_error_fraction)
    return result
