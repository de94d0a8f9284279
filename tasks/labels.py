"""Prefect task of the ``import-labels`` flow: one labels file checked and appended, with its lineage.

A retry repeats nothing: the table holds each file's rows once (its SHA-256 is the commit's app id),
and the refused rows' report is replaced whole.
"""

from __future__ import annotations

from rayline.ray_workloads.quality import labels_import
from rayline.tasks.common import io_task, record_lineage


@io_task("import-labels")
def import_labels_task(cfg: labels_import.LabelsImportConfig) -> labels_import.LabelsImportResult:
    """``labels_import.run``; lineage from the file (and the predictions it was checked against) to the table."""
    result = labels_import.run(cfg)
    if result.imported:
        record_lineage("import-labels", result, parameters={"model_name": cfg.model_name, "source": cfg.source})
    return result
