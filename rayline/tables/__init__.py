"""The night tables: nightly predictions and their errors as Delta Lake tables, partitioned by model and day.

- ``delta_tables``: opening a table, a night's partition, a night's commit (``NightCommit``), finding a run's commit;
- ``delta_log``: the ``_delta_log`` read directly, so a lookup never reads the whole history;
- ``predictions_table``: the writer (the driver's one commit per table per night) and the schemas;
- ``prediction_reads``: the readers and vacuum (the face users call: ``rayline.tables.read_night_pair(...)``);
- ``labels``: the table of people's answers; ``delta_probe``: proof that delta-rs can write where a night will.

It imports ``rayline.storage`` and the cross-cutting modules only: never ``rayline.models`` or
``rayline.lineage`` (the lineage graph reads the tables, so a migration's lineage writer is passed in).
"""

from rayline.tables.prediction_reads import (
    committed_nights,
    latest_night_commit,
    read_night,
    read_night_pair,
    vacuum_tables,
)

__all__ = ["committed_nights", "latest_night_commit", "read_night", "read_night_pair", "vacuum_tables"]
