"""The predictions tables as outside readers see them, through a wider schema, reruns and a run that died.

Real nights from ``batch_inference.run`` on the session's Ray cluster (a few
dozen digits and broken images, one actor), read back the way people outside
rayline read a Delta table: ``deltalake`` to pyarrow and to pandas in a
process of their own (``delta_reader``), ``ray.data.read_delta``, and
rayline's own readers; after another night's commit adds a column, after a
rerun, at an older version (time travel); after a run that died between its
actors' writes and its commit, and after the vacuum of that run's orphans.
Then a night and its rerun on the S3-protocol server, an object overwritten
there between the listing and its read. Each checks rows and outcomes, never
timing: exactly one row per input across ``predictions`` and
``prediction_errors``, from the run that committed the night.
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
from tests.integration.prediction_tables_support import (
    Inputs,
    assert_readers_see,
    files_of,
    make_inputs,
    night_config,
    outside_reads,
    ray_rows,
    run_dying_before_compaction,
    seed_inputs,
    tables_of,
    written_files,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(scope="module", name="inputs")
def _inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return make_inputs(tmp_path_factory)


D1, D2 = "2026-11-26", "2026-11-27"
EXTRA = "calibrated_confidence"  # what a future prediction column looks like


def _add_actions(table: str, night: Night) -> list[tuple[str, int, int]]:
    """(path, size, modification time) of the night's committed files, from the Delta log."""
    actions = pa.table(DeltaTable(table).get_add_actions(flatten=True)).to_pylist()
    return sorted(
        (a["path"], a["size_bytes"], a["modification_time"])
        for a in actions
        if (a["partition.model_name"], a["partition.dt"]) == (night.model_name, night.dt)
    )


# ---------------------------------------------------------------- tests


def test_outside_readers_see_exactly_the_committed_night_through_a_wider_schema_a_rerun_and_a_run_that_died(
    inputs: Inputs, tmp_path: Path
) -> None:
    root = str(tmp_path / "tables")
    tables = tables_of(root)
    table, old_night, new_night = tables["predictions"], Night("digits", D1), Night("digits", D2)
    first = batch_inference.run(night_config(inputs, root, D1, "first"))
    assert (first.inputs, first.errors, first.replaced) == (40, 4, False)
    assert_readers_see(root, "digits", D1, inputs.expected, "first")
    before = _add_actions(table, old_night)
    uris_before = DeltaTable(table).file_uris(file_pruning_predicate=old_night.filters)
    mtimes = {path: os.stat(path).st_mtime_ns for path in files_of(first, "predictions")}

    # a later writer whose prediction files carry one more column commits another night
    run_id = new_run_id()
    rows = read_night(table, "digits", D1).drop_columns(list(PARTITION_COLUMNS))
    wider = rows.append_column(EXTRA, pa.array(np.linspace(0, 1, rows.num_rows), pa.float32()))
    part = write_data_file(table, new_night, run_id, 0, wider)
    commit_night(table, [part], new_night, run_id, PREDICTIONS_SCHEMA.append(pa.field(EXTRA, pa.float32())))

    old_rows, new_rows = read_night(table, "digits", D1), read_night(table, "digits", D2)
    assert old_rows.column(EXTRA).null_count == old_rows.num_rows == first.predictions
    assert new_rows.column(EXTRA).null_count == 0 and new_rows.num_rows == rows.num_rows
    assert sorted(old_rows.column("uri").to_pylist()) == sorted(rows.column("uri").to_pylist())
    for seen in outside_reads([{"table": table, "model_name": "digits", "dt": D1, "version": None}])[0].values():
        assert EXTRA in seen["columns"] and seen["nulls"][EXTRA] == first.predictions
    old_by_ray = ray_rows(table, "digits", D1, None)
    assert len(old_by_ray) == first.predictions and all(row[EXTRA] is None for row in old_by_ray)

    # the old night's data files are the same files, untouched: only the schema changed in the log
    assert _add_actions(table, old_night) == before
    assert DeltaTable(table).file_uris(file_pruning_predicate=old_night.filters) == uris_before
    assert {path: os.stat(path).st_mtime_ns for path in files_of(first, "predictions")} == mtimes

    # the rerun's writer knows nothing of the column, and still commits into the wider table
    second = batch_inference.run(night_config(inputs, root, D1, "second"))
    assert second.replaced and second.predictions_version > first.predictions_version
    again = read_night(table, "digits", D1)
    assert again.column(EXTRA).null_count == again.num_rows
    assert read_night(table, "digits", D2).column(EXTRA).null_count == 0
    assert_readers_see(root, "digits", D1, inputs.expected, "second")
    assert_readers_see(root, "digits", D1, inputs.expected, "first", at=first)  # time travel

    # a run that died after its actors wrote, before it committed: its files are orphans nobody reads
    versions = {kind: table_version(uri) for kind, uri in tables.items()}
    died = new_run_id()
    run_dying_before_compaction(night_config(inputs, root, D1, "died", per_task=4), died)
    orphans = written_files(root, old_night, died)
    assert any(orphans.values()) and all(os.path.exists(p) for paths in orphans.values() for p in paths)
    assert {kind: table_version(uri) for kind, uri in tables.items()} == versions, "the dead run committed"
    commit = night_commit(table, "digits", D1)
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


def test_a_night_and_its_rerun_on_s3_read_back_with_an_object_overwritten_between_the_listing_and_its_read(
    inputs: Inputs, s3_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read back through deltalake with rayline's storage options (endpoint, plain http, region) in an outside
    process, through Ray and rayline. A row names the version it was predicted from: a GET that returns another
    ETag than the listing's is the ``fetch`` error ``ObjectChangedError`` (as in ingest), and the night's rerun
    predicts the new one."""
    incoming = storage.join(s3_storage, "incoming")
    uris = seed_inputs(incoming, digits=6, corrupt=2)
    digits = sorted(uri for uri in uris if "/digit-" in uri)
    broken = sorted(uris - set(digits))
    changed = digits[0]
    listed = {o.uri: o.etag for o in storage.list_objects(incoming)}
    begin = batch_inference._begin_night

    def overwritten_once_listed(source: str, staging: str, part_objects: int) -> ListingStart:
        listing = begin(source, staging, part_objects)
        storage.write_bytes_atomic(changed, storage.read_bytes(digits[-1]))  # a PUT to the S3-protocol server
        return listing

    # blocks of 4: the night's 8 inputs compact from two blocks per table
    config = night_config(Inputs(inputs.digits, incoming, uris), s3_storage, D1, "first", per_task=4)
    with monkeypatch.context() as patch:
        patch.setattr(batch_inference, "_begin_night", overwritten_once_listed)
        first = batch_inference.run(config)
    assert first.predictions_table == storage.join(s3_storage, PREDICTIONS_TABLE)
    now = {o.uri: o.etag for o in storage.list_objects(incoming)}
    assert now[changed] != listed[changed]
    pair = read_night_pair(s3_storage, "digits", D1)
    assert (first.predictions, first.errors) == (5, 3)
    assert sorted(pair.errors.column("uri").to_pylist()) == sorted([changed, *broken])
    (error,) = [row for row in pair.errors.to_pylist() if row["uri"] == changed]
    assert (error["stage"], error["error_type"]) == ("fetch", "ObjectChangedError")
    assert listed[changed] in error["error_message"] and now[changed] in error["error_message"]
    predicted = dict(zip(*(pair.predictions.column(c).to_pylist() for c in ("uri", "etag")), strict=True))
    assert predicted == {uri: listed[uri] for uri in digits[1:]}  # each row at the version its GET read

    second = batch_inference.run(config.model_copy(update={"flow_run_id": "second"}))
    assert second.replaced and (second.predictions, second.errors) == (6, 2)
    pair = read_night_pair(s3_storage, "digits", D1)
    assert sorted(pair.errors.column("uri").to_pylist()) == broken
    # the broken images fail alike in both runs: the first's only other error is the changed object
    assert first.error_types == {**second.error_types, "ObjectChangedError": 1}
    predicted = dict(zip(*(pair.predictions.column(c).to_pylist() for c in ("uri", "etag")), strict=True))
    assert predicted == {uri: now[uri] for uri in digits}
    assert_readers_see(s3_storage, "digits", D1, uris, "second")
    assert_readers_see(s3_storage, "digits", D1, uris, "first", at=first)
