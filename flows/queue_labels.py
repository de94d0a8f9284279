"""Flow ``queue-labels``: a night's photos most worth labelling next, as a Label Studio task file and a CSV
(:mod:`rayline.ray_workloads.quality.queue`); drift is judged against the monitor's reference.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from rayline.models.registry import CHAMPION
from rayline.ray_workloads.monitoring.monitor import DriftThresholds
from rayline.ray_workloads.quality.queue import QueueResult
from rayline.ray_workloads.quality.requests import LabelQueueRequest as LabelQueueRequest  # with the flow
from rayline.storage.layout import root_uri
from rayline.tasks.flow_lineage import openlineage_flow
from rayline.tasks.labels import label_queue_task
from rayline.tasks.monitoring import reference_task
from rayline.tasks.registry_lookups import resolve_version_task


@openlineage_flow
@flow(name="queue-labels")
def queue_labels(request: LabelQueueRequest) -> QueueResult:
    """Queue ``budget`` photos of the request's night: ``random_share`` of them drawn at random (the labels
    that may judge a challenger), the rest those whose labels would teach most: unsure, disputed by the
    night's shadow version, or of classes the night predicted far more often than the reference."""
    name, day, root = request.model_name, request.night.isoformat(), root_uri()
    champion = resolve_version_task(name, CHAMPION)
    reference = reference_task(champion, root, None, DriftThresholds().low_confidence)
    cfg = request.config(root, reference.counts)
    result = label_queue_task(cfg)
    create_table_artifact(
        key="label-queue",
        table=[
            {
                "uri": q.uri,
                "predicted": q.predicted_class,
                "selection": q.selection,
                "priority": round(q.priority, 3),
                "why": q.why(),
            }
            for q in result.queued
        ],  # fmt: skip
        description=f"{name} {day}: {len(result.queued)} of {result.candidates} unlabelled photos, {result.drawn} "
        f"drawn at random; Label Studio tasks {result.label_studio_uri}, CSV {result.csv_uri}",
    )
    return result
