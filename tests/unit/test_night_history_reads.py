"""Finding a night's commit costs what the night needs, not the table's whole history."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, Transaction

from rayline.storage import layout
from rayline.tables import delta_tables, prediction_reads, predictions_table
from rayline.tables.delta_tables import Night
from tests.unit.test_predictions_table import found

pytestmark = pytest.mark.unit

SCHEMA = pa.schema([("image_id", pa.string()), ("label", pa.string())])


def _commit(table: str, night: Night, run_id: str) -> delta_tables.NightCommit:
    rows = pa.table({"image_id": ["img-0"], "label": [run_id]}, schema=SCHEMA)
    files = [predictions_table.write_data_file(table, night, run_id, 0, rows)]
    return predictions_table.commit_night(table, files, night, run_id, SCHEMA)


def test_every_nights_current_run_comes_from_the_checkpoint_not_every_commit(tmp_path: Path) -> None:
    predictions = layout.table_uri(str(tmp_path), layout.PREDICTIONS_TABLE)
    nights = [Night("digits", f"2026-11-0{day}") for day in range(1, 6)]
    for i, night in enumerate(nights):
        _commit(predictions, night, f"run-{i}")
    _commit(predictions, nights[0], "rerun-0")
    DeltaTable(predictions).create_checkpoint()
    checkpoint = DeltaTable(predictions).version()
    late = Night("digits", "2026-11-20")
    _commit(predictions, late, "late")
    # what Delta's log cleanup leaves: the commit files a checkpoint covers are gone
    for version in range(checkpoint):
        os.remove(os.path.join(predictions, "_delta_log", f"{version:020d}.json"))

    errors = layout.table_uri(str(tmp_path), layout.ERRORS_TABLE)
    assert prediction_reads.current_predictions_runs(errors) == {
        nights[0]: "rerun-0",
        **{night: f"run-{i}" for i, night in enumerate(nights) if i},
        late: "late",
    }
    tbl = delta_tables.open_table(predictions)
    assert found(delta_tables.find_commit(predictions, tbl, late)) == ("late", checkpoint + 1, 1)
    assert delta_tables.find_commit(predictions, tbl, Night("digits", "2026-10-01")) is None, "no night, no read"


def test_an_old_night_is_found_by_its_transaction_past_the_recent_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delta_tables, "RECENT_COMMITS", 2)
    table = layout.table_uri(str(tmp_path), layout.PREDICTIONS_TABLE)
    old, other = Night("digits", "2026-11-01"), Night("digits", "2026-11-02")
    first = _commit(table, old, "first")
    again = _commit(table, old, "again")
    for i in range(3):
        _commit(table, other, f"other-{i}")
    tbl = delta_tables.open_table(table)
    newest = delta_tables.find_commit(table, tbl, old)
    assert found(newest) == ("again", again.version, 2)
    assert newest is not None and newest.to_metadata()["rayline.run_id"] == "again"
    assert found(delta_tables.find_commit(table, tbl, old, "first")) == ("first", first.version, 1)
    assert delta_tables.find_commit(table, tbl, old, "other-0") is None, "that run never committed this night"
    as_of_first = delta_tables.open_table(table, first.version)
    assert found(delta_tables.find_commit(table, as_of_first, old)) == ("first", first.version, 1)


def test_nights_an_earlier_release_committed_twice_are_found_in_the_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = layout.table_uri(str(tmp_path), layout.PREDICTIONS_TABLE)
    nights = [Night("digits", f"2026-11-0{day}") for day in range(1, 7)]
    real = predictions_table.Transaction

    def earlier_release(app_id: str, version: int, last_updated: int | None = None) -> Transaction:
        return real(app_id, 1 if app_id.startswith("rayline-run/") else version, last_updated)

    monkeypatch.setattr(predictions_table, "Transaction", earlier_release)  # every run's transaction at 1
    for i, night in enumerate(nights):
        _commit(table, night, f"first-{i}")
        _commit(table, night, f"second-{i}")
    monkeypatch.undo()
    _commit(table, nights[0], "third-0")
    expected = {night: f"second-{i}" for i, night in enumerate(nights)} | {nights[0]: "third-0"}
    tbl = delta_tables.open_table(table)
    assert delta_tables.current_runs(table, tbl) == expected, "more nights than looked up one by one"
    monkeypatch.setattr(delta_tables, "MAX_NIGHTS_LOOKED_UP_ONE_BY_ONE", 10)
    assert delta_tables.current_runs(table, tbl) == expected, "each night looked up by its transaction"
