"""Prefect task: upkeep of the night tables (vacuum), run by the ``monitor`` flow."""

from __future__ import annotations

from prefect import get_run_logger

from rayline.tables.prediction_reads import vacuum_tables
from rayline.tasks.common import maintenance_task

# Listing a table's folder and deleting files: minutes at most, even for a large table on S3.
VACUUM_TIMEOUT_S = 1800
_LOGGED_FILES = 5


@maintenance_task("vacuum-night-tables", timeout_s=VACUUM_TIMEOUT_S)
def vacuum_tables_task(root: str, retention_hours: int) -> int:
    """Delete the files of both night tables that no version within ``retention_hours`` needs; how many.
    Not a dry run: versions current within the retention stay readable (``rayline.tables.prediction_reads``)."""
    logger = get_run_logger()
    removed = vacuum_tables(root, retention_hours, dry_run=False)
    for table, files in removed.items():
        shown = ", ".join(files[:_LOGGED_FILES]) + (", …" if len(files) > _LOGGED_FILES else "")
        listed = f": {shown}" if files else ""
        logger.info("vacuumed %s (retention %d h): %d files deleted%s", table, retention_hours, len(files), listed)
    return sum(len(files) for files in removed.values())
