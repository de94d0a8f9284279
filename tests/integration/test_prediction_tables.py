"""The predictions tables as outside readers see them, through reruns, a killed driver and a wider schema.

Real nights from ``batch_inference.run`` on the session's Ray cluster (a few
dozen digits and broken images, one actor), read back the way people outside
rayline read a Delta table: ``deltalake`` to pyarrow and to pandas in a
process of their own (``delta_reader``), ``ray.data.read_delta``, and
rayline's own readers; after a rerun, at an older version (time travel); after
a driver killed between its actors' writes and its commit (``night_driver``),
and after the vacuum of that driver's orphans. Then a night and its rerun on the
S3-protocol server, an object overwritten there between the listing and its read,
and a column that a later night's files add. Each checks
rows and outcomes, never timing: exactly one row per input across
``predictions`` and ``prediction_errors``, from the run that committed the
night.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from rayline import storage
from rayline.ray_workloads.nightly import batch_inference
from rayline.ray_workloads.nightly.batch_inference import new_run_id
from rayline.storage.layout import PREDICTIONS_TABLE
from rayline.storage.listing import ListingStart
from rayline.tables.delta_tables import PARTITION_COLUMNS, Night, night_commit, table_version
from rayline.tables.prediction_reads import read_night, read_night_pair, vacuum
from rayline.tables.predictions_table import PREDICTIONS_SCHEMA, commit_night, write_data_file
from tests.integration.night_driver import kill_once_written
from tests.integration.prediction_tables_support import (
    Inputs,
    assert_readers_see,
    files_of,
    make_inputs,
    night_config,
    outside_reads,
    ray_rows,
    seed_inputs,
    tables_of,
    written_files,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(scope="module", name="inputs")
def _inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return make_inputs(tmp_path_factory)


D1, D2 = "2026-11-26", "2026-11-27"
# ---------------------------------------------------------------- tests


def test_outside_readers_see_exactly_the_committed_night_through_a_rerun_and_a_killed_driver(
    inputs: Inputs, tmp_path: Path
) -> None:
    root = str(tmp_path / "tables")
    tables = tables_of(root)
    first = batch_inference.run(night_config(inputs, root, D1, "first"))
    assert (first.inputs, first.errors, first.replaced) == (40, 4, False)
    assert_readers_see(root, "digits", D1, inputs.expected, "first")

    second = batch_inference.run(night_config(inputs, root, D1, "second"))
    assert second.replaced and second.predictions_version > first.predictions_version
    assert_readers_see(root, "digits", D1, inputs.expected, "second")
    assert_readers_see(root, "digits", D1, inputs.expected, "first", at=first)  # time travel

    # a driver killed after its actors wrote, before it committed: its files are orphans nobody reads
    versions = {kind: table_version(uri) for kind, uri in tables.items()}
    orphans = kill_once_written(night_config(inputs, root, D1, "killed", per_task=4), new_run_id(), written_files)
    assert any(orphans.values()) and all(os.path.exists(p) for paths in orphans.values() for p in paths)
    assert {kind: table_version(uri) for kind, uri in tables.items()} == versions, "the killed run committed"
    commit = night_commit(tables["predictions"], "digits", D1)
    assert commit is not None and commit.run_id == second.run_id
    assert_readers_see(root, "digits", D1, inputs.expected, "second")

    # vacuum removes exactly the orphans; the first run's files stay for its kept version
    kept = {"predictions": first.predictions_version, "errors": first.errors_version}
    for kind, uri in tables.items():
        removed = vacuum(uri, retention_hours=0, allow_short_retention=True, dry_run=False, keep_versions=[kept[kind]])
        assert sorted(os.path.join(uri, path) for path in removed) == orphans[kind]
    assert not any(os.path.exists(p) for paths in orphans.values() for p in paths)
    assert all(os.path.exists(p) for p in files_of(first, "predictions") + files_of(first, "errors"))
    assert_readers_see(root, "digits", D1, inputs.expected, "second")
    assert_readers_see(root, "digits", D1, inputs.expected, "first", at=first)


def test_a_night_and_its_rerun_on_s3_read_back_through_deltalake(inputs: Inputs, s3_storage: str) -> None:
    incoming = storage.join(s3_storage, "incoming")
    on_s3 = Inputs(inputs.digits, incoming, seed_inputs(incoming, digits=20, corrupt=4))
    first = batch_inference.run(night_config(on_s3, s3_storage, D1, "first"))
    second = batch_inference.run(night_config(on_s3, s3_storage, D1, "second"))
    assert second.replaced and first.predictions_table == storage.join(s3_storage, PREDICTIONS_TABLE)
    # deltalake with rayline's storage options (endpoint, plain http, region) in an outside process, Ray, rayline
    assert_readers_see(s3_storage, "digits", D1, on_s3.expected, "second")
    assert_readers_see(s3_storage, "digits", D1, on_s3.expected, "first", at=first)


def test_an_object_overwritten_between_the_listing_and_its_read_is_an_error_row_and_the_rerun_predicts_it(
    inputs: Inputs, s3_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row names the version it was predicted from: a GET that returns another ETag than the listing's is
    the ``fetch`` error ``ObjectChangedError`` (as in ingest), and the night's next run predicts the new one."""
    incoming = storage.join(s3_storage, "incoming")
    uris = sorted(seed_inputs(incoming, digits=6, corrupt=0))
    changed = uris[0]
    listed = {o.uri: o.etag for o in storage.list_objects(incoming)}
    begin = batch_inference._begin_night

    def overwritten_once_listed(source: str, staging: str, part_objects: int) -> ListingStart:
        listing = begin(source, staging, part_objects)
        storage.write_bytes_atomic(changed, storage.read_bytes(uris[-1]))  # a PUT to the S3-protocol server
        return listing

    config = night_config(Inputs(inputs.digits, incoming, frozenset(uris)), s3_storage, D1, "first")
    with monkeypatch.context() as patch:
        patch.setattr(batch_inference, "_begin_night", overwritten_once_listed)
        first = batch_inference.run(config)
    now = {o.uri: o.etag for o in storage.list_objects(incoming)}
    assert now[changed] != listed[changed]
    pair = read_night_pair(s3_storage, "digits", D1)
    assert (first.predictions, first.errors, first.error_types) == (5, 1, {"ObjectChangedError": 1})
    error = pair.errors.to_pylist()[0]
    assert (error["uri"], error["stage"], error["error_type"]) == (changed, "fetch", "ObjectChangedError")
    assert listed[changed] in error["error_message"] and now[changed] in error["error_message"]
    predicted = dict(zip(*(pair.predictions.column(c).to_pylist() for c in ("uri", "etag")), strict=True))
    assert predicted == {uri: listed[uri] for uri in uris[1:]}  # each row at the version its GET read

    rerun = batch_inference.run(config.model_copy(update={"flow_run_id": "rerun"}))
    assert (rerun.predictions, rerun.errors) == (6, 0)
    pair = read_night_pair(s3_storage, "digits", D1)
    assert dict(zip(*(pair.predictions.column(c).to_pylist() for c in ("uri", "etag")), strict=True)) == now


EXTRA = "calibrated_confidence"  # what a future prediction column looks like


def _add_actions(table: str, night: Night) -> list[tuple[str, int, int]]:
    """(path, size, modification time) of the night's committed files, from the Delta log."""
    actions = pa.table(DeltaTable(table).get_add_actions(flatten=True)).to_pylist()
    return sorted(
        (a["path"], a["size_bytes"], a["modification_time"])
        for a in actions
        if (a["partition.model_name"], a["partition.dt"]) == (night.model_name, night.dt)
    )


def test_a_new_prediction_column_reads_as_null_in_old_nights_without_rewriting_them(
    inputs: Inputs, tmp_path: Path
) -> None:
    root = str(tmp_path / "tables")
    table = tables_of(root)["predictions"]
    old_night, new_night = Night("digits", D1), Night("digits", D2)
    old = batch_inference.run(night_config(inputs, root, D1, "old"))
    before = _add_actions(table, old_night)
    uris_before = DeltaTable(table).file_uris(file_pruning_predicate=old_night.filters)
    mtimes = {path: os.stat(path).st_mtime_ns for path in files_of(old, "predictions")}

    # a later writer whose prediction files carry one more column
    run_id = new_run_id()
    rows = read_night(table, "digits", D1).drop_columns(list(PARTITION_COLUMNS))
    wider = rows.append_column(EXTRA, pa.array(np.linspace(0, 1, rows.num_rows), pa.float32()))
    part = write_data_file(table, new_night, run_id, 0, wider)
    commit_night(table, [part], new_night, run_id, PREDICTIONS_SCHEMA.append(pa.field(EXTRA, pa.float32())))

    old_rows, new_rows = read_night(table, "digits", D1), read_night(table, "digits", D2)
    assert old_rows.column(EXTRA).null_count == old_rows.num_rows == old.predictions
    assert new_rows.column(EXTRA).null_count == 0 and new_rows.num_rows == rows.num_rows
    assert sorted(old_rows.column("uri").to_pylist()) == sorted(rows.column("uri").to_pylist())
    for seen in outside_reads([{"table": table, "model_name": "digits", "dt": D1, "version": None}])[0].values():
        assert EXTRA in seen["columns"] and seen["nulls"][EXTRA] == old.predictions
    old_by_ray = ray_rows(table, "digits", D1, None)
    assert len(old_by_ray) == old.predictions and all(row[EXTRA] is None for row in old_by_ray)

    # the old night's data files are the same files, untouched: only the schema changed in the log
    assert _add_actions(table, old_night) == before
    assert DeltaTable(table).file_uris(file_pruning_predicate=old_night.filters) == uris_before
    assert {path: os.stat(path).st_mtime_ns for path in files_of(old, "predictions")} == mtimes

    # and today's writer, which knows nothing of the column, still commits into the wider table
    rerun = batch_inference.run(night_config(inputs, root, D1, "narrow"))
    assert rerun.replaced
    again = read_night(table, "digits", D1)
    assert again.column(EXTRA).null_count == again.num_rows and set(again.column("flow_run_id").to_pylist()) == {
        "narrow"
    }
    assert read_night(table, "digits", D2).column(EXTRA).null_count == 0
