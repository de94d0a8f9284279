"""Prefect tasks over the labels: one labels file checked and appended, with its lineage (``import-labels``);
the labelled paired test the promotion gates ask.

A retry of an import repeats nothing: the table holds each file's rows once (its SHA-256 is the commit's app
id), and the flow run's id in that commit makes a retry after it landed report what it added.
"""

from __future__ import annotations

from rayline import events
from rayline.config import get_settings
from rayline.ray_workloads.quality import labels_import, queue, training_set
from rayline.ray_workloads.quality.paired import PairedTest
from rayline.ray_workloads.quality.reading import labelled_gate
from rayline.tasks.common import emit, io_task, record_lineage, run_context


@io_task("import-labels")
def import_labels_task(cfg: labels_import.LabelsImportConfig) -> labels_import.LabelsImportResult:
    """``labels_import.run`` as this flow run, with lineage from the file (and predictions checked) to the table."""
    result = labels_import.run(cfg.model_copy(update={"run_id": cfg.run_id or run_context().flow_run_id}))
    if result.imported:
        record_lineage("import-labels", result, parameters={"model_name": cfg.model_name, "source": cfg.source})
    return result


@io_task("labelled-gate")
def labelled_gate_task(root: str, model_name: str, champion: int, challenger: int) -> PairedTest:
    """``quality.reading.labelled_gate``: does ``challenger`` beat ``champion`` on the labels?"""
    return labelled_gate(root, model_name, champion, challenger)


@io_task("announce-labels")
def announce_labels_task(root: str, result: labels_import.LabelsImportResult) -> int:
    """Emit ``rayline.labels.arrived`` for an import that added labels; it asks for a retraining on them
    (``rayline.retrain=true``) once the labels new to training reach ``RAYLINE_RETRAIN_MIN_NEW_LABELS``.
    Returns those pending labels. One event per import: a retry emits the same event."""
    pending = training_set.pending_labels(root, result.model_name)
    eligible = pending >= get_settings().retrain_min_new_labels
    emit(
        events.LABELS_ARRIVED,
        f"rayline.labels.{result.model_name}",
        payload={"model": result.model_name, "imported": result.imported, "pending": pending,
                 "import_id": result.import_id, "labels_version": result.labels_version},
        labels={events.RETRAIN_LABEL: "true" if eligible else "false", "rayline.model": result.model_name},
        idempotency_key=f"{result.model_name}/{result.import_id}",
    )  # fmt: skip
    return pending


@io_task("queue-labels")
def label_queue_task(cfg: queue.QueueConfig) -> queue.QueueResult:
    """``queue.run``: the night's photos most worth labelling, as Label Studio tasks and a CSV."""
    result = queue.run(cfg)
    record_lineage(
        "queue-labels", result, parameters={"model_name": cfg.model_name, "dt": cfg.dt, "budget": cfg.budget}
    )
    return result
