"""`rayline migrate-predictions`: legacy manifest nights into the night tables, and vacuum's refusal before that."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rayline import storage
from rayline.cli import app
from rayline.errors import ConfigError, StorageError
from rayline.lineage.graph import build_graph, render_text
from rayline.lineage.nights import record_migrated_night
from rayline.storage import layout
from rayline.tables import delta_tables, prediction_migration, prediction_reads, predictions_table
from rayline.tables.prediction_migration import Outcome, migrate_predictions
from rayline.tables.predictions_table import PREDICTIONS_SCHEMA

pytestmark = pytest.mark.unit

DT = "2026-11-27"
OLD_RUN = "20261128T020001-0badc0de"


def _legacy_predictions(n: int, start: int = 0) -> pa.Table:
    """Rows as the old nightly runs wrote them: ``model_name`` as a data column, no ``top_k_class`` yet, and
    ``confidence`` as float64 (the table stores float32)."""
    ids = range(start, start + n)
    return pa.table(
        {
            "uri": [f"s3://in/{i}.png" for i in ids],
            "etag": [f"e{i}" for i in ids],
            "predicted_index": pa.array([i % 10 for i in ids], pa.int64()),
            "predicted_class": [str(i % 10) for i in ids],
            "confidence": pa.array([0.5] * n, pa.float64()),
            "top_k_index": pa.array([[i % 10, 0] for i in ids], pa.list_(pa.int64())),
            "top_k_prob": pa.array([[0.5, 0.1]] * n, pa.list_(pa.float64())),
            "inference_ms": pa.array([1.5] * n, pa.float32()),
            "model_name": ["digits"] * n,
            "model_version": pa.array([2] * n, pa.int64()),
            "code_version": ["git:abc"] * n,
            "flow_run_id": ["flow-1"] * n,
        }
    )


def _legacy_night(root: str, model: str = "digits", dt: str = DT) -> Path:
    """A committed legacy night: two prediction parts, one error part, a stray run's leftovers, manifest, _SUCCESS."""
    night = Path(layout.table_uri(root, layout.PREDICTIONS_TABLE)) / model / f"dt={dt}"
    run = night / f"run-{OLD_RUN}"
    (run / "predictions").mkdir(parents=True)
    (run / "errors").mkdir()
    parts = [run / "predictions" / "part-a.parquet", run / "predictions" / "part-b.parquet"]
    pq.write_table(_legacy_predictions(3), parts[0])
    pq.write_table(_legacy_predictions(2, start=3), parts[1])
    errors = run / "errors" / "part-a.parquet"
    pq.write_table(
        pa.table({"uri": ["s3://in/bad.png"], "stage": ["decode"], "error_type": ["X"], "error_message": ["m"]}), errors
    )
    stray = night / "run-20261127T000000-deadbeef" / "predictions"  # a crashed earlier run: not in the manifest
    stray.mkdir(parents=True)
    pq.write_table(_legacy_predictions(7), stray / "part-z.parquet")
    manifest = {
        "kind": "rayline.predictions",
        "partition": f"dt={dt}",
        "run_id": OLD_RUN,
        "input_uri": "s3://in",
        "input_content_hash": "feedface",
        "inputs": 6,
        "predictions": 5,
        "errors": 1,
        "error_types": {"X": 1},
        "model": {"name": model, "version": 2, "weights_uri": f"{root}/models/{model}/v2/weights.pt"},
        "code_version": "git:abc",
        "flow_run_id": "flow-1",
        "files": {"predictions": [str(p) for p in parts], "errors": [str(errors)]},
        "committed_at": "2026-11-28T02:05:00+00:00",
    }
    (night / "manifest.json").write_text(json.dumps(manifest))
    (night / "_SUCCESS").write_text(OLD_RUN + "\n")
    return night


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by("uri")


def test_a_legacy_night_moves_into_both_tables_once(local_storage: str) -> None:
    root = local_storage
    legacy = _legacy_night(root)
    predictions_uri = layout.table_uri(root, layout.PREDICTIONS_TABLE)
    with pytest.raises(ConfigError, match="rayline migrate-predictions"):
        prediction_reads.refuse_legacy_nights(predictions_uri)

    (dry,) = migrate_predictions(root, record=record_migrated_night, dry_run=True)
    assert dry.outcome is Outcome.WOULD_MIGRATE and "5 predictions, 1 errors" in dry.message
    assert legacy.exists() and delta_tables.table_version(predictions_uri) is None

    (result,) = migrate_predictions(root, record=record_migrated_night)
    assert result.outcome is Outcome.MIGRATED, result.message
    assert not legacy.exists() and not legacy.parent.exists(), "the legacy night and its empty model folder are gone"

    night = prediction_reads.read_night_pair(root, "digits", DT)
    assert night.commit.run_id == f"migrated-{OLD_RUN}" and night.commit.version == result.predictions_version
    assert night.errors_version == result.errors_version
    expected = _legacy_predictions(5)
    got = _sorted(night.predictions)
    # same rows: every column the legacy files had, values equal once cast to the table's types
    for name in expected.column_names:
        field = PREDICTIONS_SCHEMA.field(name) if name in PREDICTIONS_SCHEMA.names else pa.field(name, pa.string())
        assert got.column(name).to_pylist() == expected.column(name).cast(field.type).to_pylist(), name
    assert got.column("top_k_class").null_count == 5, "a column the old files lacked is null"
    assert set(got.column("dt").to_pylist()) == {DT}, "partition columns come from the log"
    assert night.errors.column("uri").to_pylist() == ["s3://in/bad.png"]
    # the data files hold no partition column; the stray run's rows were not copied
    table = delta_tables.open_table(predictions_uri)
    for path in table.file_uris():
        assert "model_name" not in pq.read_schema(path).names and f"migrated-{OLD_RUN}" in path
    assert table.to_pyarrow_dataset().count_rows() == 5
    info = night.commit.info
    assert (info["rayline.input_uri"], info["rayline.input_content_hash"], info["rayline.model_version"]) == (
        "s3://in",
        "feedface",
        2,
    )

    versions = (delta_tables.table_version(predictions_uri), night.errors_version)
    assert migrate_predictions(root, record=record_migrated_night) == [], "a rerun finds nothing to do"
    assert delta_tables.table_version(predictions_uri) == versions[0]
    assert prediction_reads.vacuum_tables(root) == {
        predictions_uri: [],
        layout.table_uri(root, layout.ERRORS_TABLE): [],
    }, "no legacy folder left: vacuum runs, and needs every file"

    # lineage: the night names its Delta version and leads to the legacy manifest
    graph = build_graph(predictions_uri, dt=DT, model_name="digits")
    assert graph.uri == f"{predictions_uri}/model_name=digits/dt={DT}" and graph.stage == "migrate_predictions"
    assert graph.details["delta_version"] == result.predictions_version
    assert f"Delta version {result.predictions_version}, run migrated-{OLD_RUN}" in render_text(graph)
    assert [n.uri for n in graph.upstream] == [str(legacy / "manifest.json")]


def test_a_night_the_table_already_has_is_superseded_and_its_folder_removed(local_storage: str) -> None:
    root = local_storage
    predictions_uri = layout.table_uri(root, layout.PREDICTIONS_TABLE)
    night = delta_tables.Night("digits", DT)
    rows = prediction_migration.conform(_legacy_predictions(1), PREDICTIONS_SCHEMA, "a newer nightly run")
    newer = [predictions_table.write_data_file(predictions_uri, night, "run-new", 0, rows)]
    committed = predictions_table.commit_night(predictions_uri, newer, night, "run-new", PREDICTIONS_SCHEMA)
    newest = delta_tables.NightCommit("run-new", committed.version, 1)
    legacy = _legacy_night(root)
    other = _legacy_night(root, dt="2026-11-26")  # not in the table: migrated
    with pytest.raises(ConfigError, match="2 legacy manifest night folder.*rayline migrate-predictions"):
        prediction_reads.vacuum(predictions_uri)

    cli = CliRunner().invoke(app, ["migrate-predictions", "--dry-run"])
    assert cli.exit_code == 0, cli.output
    assert f"superseded     digits {DT}: by run run-new (table version {committed.version}): {legacy} would be" in (
        cli.output
    )
    assert "2 legacy night(s): 1 would migrate, 1 superseded (dry run: nothing changed)" in cli.output
    assert legacy.exists() and other.exists()

    results = {r.legacy.dt: r for r in migrate_predictions(root, record=record_migrated_night)}
    assert results[DT].outcome is Outcome.SUPERSEDED
    assert results[DT].message == f"by run run-new (table version {committed.version}): {legacy} removed"
    assert results["2026-11-26"].outcome is Outcome.MIGRATED
    assert not legacy.exists() and not other.exists() and not legacy.parent.exists()
    assert delta_tables.night_commit(predictions_uri, "digits", DT) == newest, "the table's night is unchanged"
    assert prediction_reads.read_night(predictions_uri, "digits", DT).column("uri").to_pylist() == ["s3://in/0.png"]
    assert migrate_predictions(root, record=record_migrated_night) == [], "nothing left"
    cli = CliRunner().invoke(app, ["vacuum"])
    assert cli.exit_code == 0, cli.output


def test_a_night_that_fails_keeps_its_folder_and_vacuum_refuses(local_storage: str) -> None:
    root = local_storage
    legacy = _legacy_night(root)
    (legacy / "manifest.json").write_text(json.dumps({"run_id": OLD_RUN}))
    other = _legacy_night(root, dt="2026-11-26")  # migrated: the tables exist, and vacuum looks at them

    cli = CliRunner().invoke(app, ["migrate-predictions"])
    assert cli.exit_code == 1, cli.output
    assert f"failed         digits {DT}: InputDataError" in cli.output and "legacy folder kept" in cli.output
    assert "2 legacy night(s): 1 migrated, 1 failed" in cli.output
    assert legacy.exists() and not other.exists()
    with pytest.raises(ConfigError, match="1 legacy manifest night folder.*rayline migrate-predictions"):
        prediction_reads.vacuum_tables(root)
    cli = CliRunner().invoke(app, ["vacuum"])
    assert cli.exit_code == 2 and "rayline migrate-predictions" in cli.output


def test_a_migration_stopped_after_its_commits_finishes_on_rerun(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = local_storage
    legacy = _legacy_night(root)

    def crash(uri: str) -> None:
        raise StorageError(f"deleting {uri}: connection lost")

    with monkeypatch.context() as patched:
        patched.setattr(prediction_migration.storage, "remove_tree", crash)
        (failed,) = migrate_predictions(root, record=record_migrated_night)
    assert failed.outcome is Outcome.FAILED and legacy.exists()
    predictions_uri = layout.table_uri(root, layout.PREDICTIONS_TABLE)
    version = delta_tables.table_version(predictions_uri)

    (resumed,) = migrate_predictions(root, record=record_migrated_night)
    assert resumed.outcome is Outcome.MIGRATED and not legacy.exists()
    assert delta_tables.table_version(predictions_uri) == version == resumed.predictions_version, "no second commit"
    assert prediction_reads.read_night_pair(root, "digits", DT).predictions.num_rows == 5


def test_migrate_command_prints_a_line_per_night_and_a_total(local_storage: str) -> None:
    _legacy_night(local_storage)
    done = CliRunner().invoke(app, ["migrate-predictions"])
    assert done.exit_code == 0, done.output
    assert f"migrated       digits {DT}: 5 predictions, 1 errors" in done.output
    assert "1 legacy night(s): 1 migrated" in done.output
    again = CliRunner().invoke(app, ["migrate-predictions"])
    assert again.exit_code == 0 and "0 legacy night(s): nothing to migrate" in again.output
    vacuum = CliRunner().invoke(app, ["vacuum", "--retention-hours", "24"])
    assert vacuum.exit_code == 0, vacuum.output
    assert "predictions: would delete 0 file(s) (retention 24 h)" in vacuum.output
    assert CliRunner().invoke(app, ["vacuum", "--retention-hours", "1"]).exit_code == 2, "under 24 h is refused"
    assert storage.list_folders(layout.table_uri(local_storage, layout.PREDICTIONS_TABLE)) == [
        "_delta_log",
        "model_name=digits",
    ]
