"""Flow ``nightly-inference``: predict one day's arrivals with the champion, commit to Parquet."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from prefect import flow
from prefect.artifacts import create_link_artifact, create_table_artifact

from ray_workloads.batch_inference import InferenceConfig, InferenceResult
from rayline import lineage, registry, storage
from rayline.config import get_settings
from rayline.errors import InputDataError
from tasks.batch_inference import batch_inference_task

INCOMING_DIR = "incoming"
PREDICTIONS_DIR = "predictions"


class ErrorBudgetExceeded(InputDataError):
    """More inputs failed than the configured fraction allows: upstream data needs a look."""


def partition_for(day: date) -> str:
    return f"dt={day.isoformat()}"


def yesterday_utc() -> date:
    return (datetime.now(UTC) - timedelta(days=1)).date()


@flow(name="nightly-inference")
def nightly_inference(
    date: str | None = None,
    model: str = "champion",
    model_name: str = "digits",
    input_uri: str | None = None,
    max_error_fraction: float = 0.05,
    actors: int = 2,
    batch_size: int = 64,
) -> InferenceResult:
    """Predict every object under ``incoming/dt=<date>/`` (default: yesterday, UTC).

    ``model`` is an alias (``champion``) or a version (``v3``). Fails, after
    committing the partition and its errors table, when more than
    ``max_error_fraction`` of the inputs could not be predicted.
    """
    try:
        day = datetime.strptime(date, "%Y-%m-%d").date() if date else yesterday_utc()
    except ValueError as exc:
        raise InputDataError(f"date must look like 2026-11-28, got {date!r}") from exc
    root = storage.storage_root()
    partition = partition_for(day)
    version = registry.resolve(model_name, model)
    result = batch_inference_task(
        InferenceConfig(
            input_uri=input_uri or storage.join(root, INCOMING_DIR, partition),
            output_root=storage.join(root, PREDICTIONS_DIR),
            partition=partition,
            model=version,
            actors=actors,
            batch_size=batch_size,
            io_concurrency=get_settings().io_concurrency,
            code_version=lineage.code_version(),
            flow_run_id=_flow_run_id(),
        )
    )
    summary: list[dict[str, Any]] = [
        {"item": "partition", "value": partition},
        {"item": "inputs", "value": result.inputs},
        {"item": "predictions", "value": result.predictions},
        {"item": "errors", "value": f"{result.errors} ({result.error_fraction:.2%}) {result.error_types}"},
        {"item": "rows/s", "value": round(result.inputs / max(result.elapsed_s, 1e-9), 1)},
        {"item": "model", "value": result.model},
        {"item": "output", "value": result.manifest_uri},
    ]
    create_table_artifact(key="nightly-inference", table=summary)
    create_link_artifact(key="nightly-inference-output", link=result.manifest_uri, link_text=result.partition_uri)
    if result.error_fraction > max_error_fraction:
        raise ErrorBudgetExceeded(
            f"{result.errors} of {result.inputs} inputs failed ({result.error_fraction:.1%}, budget "
            f"{max_error_fraction:.1%}); see the errors table under {result.errors_uri}"
        )
    return result


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    return str(run_id) if run_id else None
