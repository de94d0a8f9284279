"""Night lookups read the Delta log's checkpoints and commit files on the S3-protocol server too."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from rayline.storage import layout
from rayline.tables import delta_tables, predictions_table
from rayline.tables.delta_tables import Night, storage_options
from tests.unit.test_predictions_table import found

pytestmark = pytest.mark.integration

SCHEMA = pa.schema([("image_id", pa.string()), ("label", pa.string())])


def _commit(table: str, night: Night, run_id: str) -> delta_tables.NightCommit:
    rows = pa.table({"image_id": ["img-0"], "label": [run_id]}, schema=SCHEMA)
    files = [predictions_table.write_data_file(table, night, run_id, 0, rows)]
    return predictions_table.commit_night(table, files, night, run_id, SCHEMA)


def test_checkpoints_and_commit_files_answer_the_lookups_on_s3(
    s3_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delta_tables, "RECENT_COMMITS", 1)  # the old night by the checkpoints' search
    table = layout.table_uri(s3_storage, layout.PREDICTIONS_TABLE)
    old, other = Night("digits", "2026-11-01"), Night("digits", "2026-11-02")
    first = _commit(table, old, "first")
    DeltaTable(table, storage_options=storage_options(table)).create_checkpoint()
    _commit(table, other, "other")
    tbl = delta_tables.open_table(table)
    assert delta_tables.current_runs(table, tbl) == {old: "first", other: "other"}
    assert found(delta_tables.find_commit(table, tbl, old)) == ("first", first.version, 1)
