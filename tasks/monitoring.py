"""Prefect tasks of the ``monitor`` flow: what it reads and the metrics file it writes. A retry repeats
nothing: the metrics file is replaced whole and the serving check's event is one per task run.
"""

from __future__ import annotations

from rayline import events, storage
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.monitoring import monitor as mon
from rayline.ray_workloads.quality import metrics, reading, shadow
from rayline.ray_workloads.serving.champion import serving_against_registry
from rayline.tables.prediction_reads import committed_nights
from rayline.tasks.common import emit, idempotency_key, io_task

# Reading the predicted classes of a few nights' partitions: minutes at most, even on S3.
DRIFT_TIMEOUT_S = 1800


@io_task("monitor-reference")
def reference_task(
    champion: ModelVersion, root: str, reference_date: str | None, low_confidence: float
) -> mon.Reference:
    """What the champion's nights are judged against (``rayline.ray_workloads.monitoring.monitor.reference_for``)."""
    return mon.reference_for(champion, root, reference_date, low_confidence)


@io_task("monitor-serving-health")
def serving_health_task(url: str, thresholds: mon.DriftThresholds, model_name: str) -> mon.ServingHealth:
    """The router's view of ``model_name`` at ``url`` (an unreachable router is a result, not an error),
    checked against the registry's champion: most traffic on another version with no rollout under way
    is unhealthy, and announced (``events.CHAMPION_NOT_SERVED``)."""
    health = serving_against_registry(mon.serving_health(url, thresholds, model_name), model_name)
    if health.champion_mismatch and health.champion is not None:
        emit(
            events.CHAMPION_NOT_SERVED,
            events.model_resource(model_name, health.champion),
            payload={
                "model": model_name,
                "champion": health.champion,
                "weights": {str(v.version): v.weight for v in health.versions},
                "problem": health.problem,
            },
            labels={"rayline.model": model_name},
            idempotency_key=idempotency_key(url, model_name),  # a retried check: one event
        )
    return health


@io_task("monitor-night-drift", timeout_s=DRIFT_TIMEOUT_S)
def night_drifts_task(
    root: str, model_name: str, partitions: int, reference: mon.Reference, thresholds: mon.DriftThresholds
) -> list[mon.PartitionDrift]:
    """The drift of each of ``model_name``'s latest ``partitions`` committed nights from ``reference``."""
    return [
        mon.night_drift(root, model_name, dt, reference, thresholds)
        for dt in committed_nights(root, model_name, partitions)
    ]


@io_task("monitor-labelled-quality", timeout_s=DRIFT_TIMEOUT_S)
def labelled_quality_task(
    root: str, model_name: str, classes: list[str], nights: int, champion: int, challenger: int | None
) -> metrics.QualityReading:
    """``quality.reading.labelled_reading``: each version's labelled nights and the challenger's paired test."""
    return reading.labelled_reading(root, model_name, classes, nights, champion, challenger)


@io_task("monitor-shadow-nights")
def shadow_nights_task(root: str, model_name: str, nights: list[str]) -> dict[str, shadow.ShadowSummary]:
    """``quality.shadow.night_summaries``: how the version in each night's shadow compared with the champion."""
    return shadow.night_summaries(root, model_name, nights)


@io_task("write-monitor-metrics")
def write_metrics_task(uri: str, text: str) -> None:
    """Replace the Prometheus textfile at ``uri`` in one atomic write (a scrape never reads half of it)."""
    storage.write_bytes_atomic(uri, text.encode())
