"""Flow ``import-labels``: people's labels for a model's predicted photos, into the ``labels`` table, each
checked against what the champion predicted (``rayline.ray_workloads.quality.labels_import``).
"""

from __future__ import annotations

from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from rayline.models.registry import CHAMPION
from rayline.ray_workloads.quality.labels_import import LabelsImportConfig, LabelsImportResult
from rayline.storage.layout import INCOMING_DIR, root_uri, under_root
from rayline.storage.layout import model_name as checked_model_name
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


@flow(name="import-labels")
def import_labels(
    file: str,
    model_name: str = "digits",
    key_base: str | None = None,
    source: str | None = None,
    selection: Literal["random"] | None = None,
) -> LabelsImportResult:
    """Import ``file`` (CSV, Parquet or JSON Lines: ``uri`` or ``key``, ``label``, optionally ``etag``,
    ``source``, ``labelled_at``) as labels of ``model_name``; ``key`` is relative to ``key_base``
    (default ``<storage>/incoming``). Refused rows are counted by reason and listed in a report.
    ``selection="random"``: the file's photos were chosen uniformly at random, whatever the models answered,
    so its labels may judge a challenger (docs/quality.md)."""
    name = checked_model_name(model_name)
    champion = resolve_version_task(name, CHAMPION)
    cfg = LabelsImportConfig(
        file_uri=file,
        root=root_uri(),
        model_name=name,
        classes=champion.classes,
        key_base=key_base or under_root(INCOMING_DIR),
        source=source,
        selection=selection,
    )
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
