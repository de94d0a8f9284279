"""Flow ``import-labels``: people's labels for a model's predicted photos, into the ``labels`` table, each
checked against what the champion predicted (``rayline.ray_workloads.quality.labels_import``).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from rayline.models.registry import CHAMPION
from rayline.ray_workloads.quality.labels_import import LabelsImportResult
from rayline.ray_workloads.quality.requests import LabelsImportRequest as LabelsImportRequest  # with the flow
from rayline.storage.layout import INCOMING_DIR, root_uri, under_root
from rayline.tasks.flow_lineage import openlineage_flow
from rayline.tasks.labels import announce_labels_task, import_labels_task
from rayline.tasks.registry_lookups import resolve_version_task


def _markdown(result: LabelsImportResult) -> str:
    lines = [
        f"### Labels import: {result.model_name}",
        "",
        f"File `{result.file_uri}` (sha256 {result.import_id[:12]}…): {result.rows_read} rows",
        "",
    ]
    if result.already_imported:
        return "\n".join([*lines, "Imported before: nothing added."]) + "\n"
    lines += [f"- imported: {result.imported}", f"- already labelled alike: {result.already_labelled}"]
    lines += [f"- refused, {reason}: {n}" for reason, n in result.rejected.items()]
    if result.rejected_uri:
        lines += ["", f"Refused rows, each with its reason: `{result.rejected_uri}`"]
    return "\n".join(lines) + "\n"


@openlineage_flow
@flow(name="import-labels")
def import_labels(request: LabelsImportRequest) -> LabelsImportResult:
    """Import the request's file as labels of its model, each checked against what the champion predicted;
    refused rows are counted by reason and listed in a report. Labels of photos chosen at random
    (``selection``) may judge a challenger (docs/quality.md)."""
    name = request.model_name
    champion = resolve_version_task(name, CHAMPION)
    cfg = request.config(root_uri(), champion.classes, under_root(INCOMING_DIR))
    result = import_labels_task(cfg)
    logger = get_run_logger()
    logger.info("%s: %d labels imported, %d refused", result.file_uri, result.imported, result.rejected_total)
    if result.imported:  # rayline.labels.arrived: enough labels new to training ask for a retraining on them
        pending = announce_labels_task(cfg.root, result)
        logger.info("%s has %d labels it has not trained on yet", name, pending)
    if result.rejected:
        logger.warning("refused labels by reason: %s (rows in %s)", result.rejected, result.rejected_uri)
    create_markdown_artifact(key="labels-import", markdown=_markdown(result))
    return result
