from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from rayline import storage
from rayline.errors import ConfigError, InputDataError, NightCommittedElsewhere, StorageError
from rayline.storage import layout
from rayline.tables import delta_tables, prediction_reads, predictions_table

pytestmark = pytest.mark.unit

SCHEMA = pa.schema([("image_id", pa.string()), ("label", pa.string()), ("score", pa.float64())])
DT = "2026-11-29"


def _rows(run_id: str, n: int = 4) -> pa.Table:
    return pa.table(
        {"image_id": [f"img-{i}" for i in range(n)], "label": [run_id] * n, "score": [0.5] * n}, schema=SCHEMA
    )


def _write(table: str, night: delta_tables.Night, run_id: str, parts: int = 2, n: int = 4) -> list[str]:
    """What the actors do: parts of ``n`` rows each under the night's folder."""
    return [predictions_table.write_data_file(table, night, run_id, p, _rows(run_id, n)) for p in range(parts)]


def _everything(table: str) -> pa.Table:
    # use_threads=False: see read_night on Arrow's scanner threads at exit
    return DeltaTable(table).to_pyarrow_dataset().to_table(use_threads=False)


def _labels(rows: pa.Table) -> set[str]:
    return set(rows.column("label").to_pylist())


def found(commit: delta_tables.NightCommit | None) -> tuple[str, int, int] | None:
    """A commit found, as a reader tells it: which run's, at which table version, the night's how-manieth."""
    return None if commit is None else (commit.run_id, commit.version, commit.night_seq)


@pytest.fixture
def table(tmp_path: Path) -> str:
    return layout.table_uri(str(tmp_path), layout.PREDICTIONS_TABLE)


def test_a_nights_commit_reads_back_as_its_run_recorded_it(table: str) -> None:
    night = delta_tables.Night("resnet", DT)
    record = delta_tables.NightCommit(
        run_id="run-a",
        model_name="resnet",
        dt=DT,
        inputs=8,
        flow_run_id="",
        error_types={"DecodeError": 1},
        plans=["eager/fp32"],
        plan_use={"eager/fp32": {"batches": 2}},
    )
    made = predictions_table.commit_night(table, _write(table, night, "run-a"), night, "run-a", SCHEMA, record=record)
    assert delta_tables.night_commit(table, "resnet", DT) == made
    assert (made.files, made.rows, made.night_seq, made.inputs, made.error_types) == (2, 8, 1, 8, {"DecodeError": 1})
    (info,) = DeltaTable(table).history(1)  # as any Delta reader sees it: flat keys, JSON text, none left empty
    assert (info["rayline.error_types"], info["rayline.flow_run_id"]) == ('{"DecodeError": 1}', "")
    assert "rayline.shadow_summary" not in info and "rayline.version" not in info


def test_commit_then_recommit_same_run_is_a_no_op(table: str) -> None:
    night = delta_tables.Night("resnet", DT)
    files = _write(table, night, "run-a")
    first = predictions_table.commit_night(table, files, {"model_name": "resnet", "dt": DT}, "run-a", SCHEMA)
    assert (first.replaced, first.already_committed) == (False, False)
    again = predictions_table.commit_night(table, files, night, "run-a", SCHEMA)
    assert again.already_committed and again.version == first.version
    assert delta_tables.table_version(table) == first.version  # nothing new in the log
    rows = prediction_reads.read_night(table, "resnet", DT)
    assert rows.num_rows == 8 and _labels(rows) == {"run-a"}
    assert set(rows.column("model_name").to_pylist()) == {"resnet"}
    assert found(delta_tables.night_commit(table, "resnet", DT)) == ("run-a", first.version, 1)


def test_rerun_replaces_the_night_and_time_travel_keeps_the_old_one(table: str) -> None:
    night = delta_tables.Night("resnet", DT)
    first = predictions_table.commit_night(table, _write(table, night, "run-a"), night, "run-a", SCHEMA)
    second = predictions_table.commit_night(table, _write(table, night, "run-b", parts=1), night, "run-b", SCHEMA)
    assert second.replaced and second.version == first.version + 1
    assert _labels(prediction_reads.read_night(table, "resnet", DT)) == {"run-b"}
    assert prediction_reads.read_night(table, "resnet", DT).num_rows == 4
    assert _labels(prediction_reads.read_night(table, "resnet", DT, version=first.version)) == {"run-a"}


def test_the_night_as_of_an_older_version_is_the_run_committed_by_then(table: str) -> None:
    night = delta_tables.Night("resnet", DT)
    first = predictions_table.commit_night(table, _write(table, night, "run-a"), night, "run-a", SCHEMA)
    predictions_table.commit_night(table, _write(table, night, "run-b", parts=1), night, "run-b", SCHEMA)
    # a table loaded at an older version still lists the later commits in its history
    as_of_first = delta_tables.night_commit(table, "resnet", DT, first.version)
    assert found(as_of_first) == ("run-a", first.version, 1)


def test_two_models_on_one_date_are_independent(table: str) -> None:
    a, b = delta_tables.Night("resnet", DT), delta_tables.Night("vit", DT)
    predictions_table.commit_night(table, _write(table, a, "run-a"), a, "run-a", SCHEMA)
    predictions_table.commit_night(table, _write(table, b, "run-b", parts=1), b, "run-b", SCHEMA)
    # a rerun of vit only
    predictions_table.commit_night(table, _write(table, b, "run-c", parts=1, n=2), b, "run-c", SCHEMA)
    assert _labels(prediction_reads.read_night(table, "resnet", DT)) == {"run-a"}
    assert prediction_reads.read_night(table, "resnet", DT).num_rows == 8
    assert prediction_reads.read_night(table, "vit", DT).num_rows == 2


@pytest.mark.parametrize("table_exists", [True, False], ids=["table-exists", "first-commits"])
def test_concurrent_commits_of_different_nights_all_land(table: str, table_exists: bool) -> None:
    nights = [delta_tables.Night(model, f"2026-11-{day:02d}") for model in ("resnet", "vit") for day in (1, 2, 3)]
    if table_exists:
        predictions_table.commit_night(table, [], delta_tables.Night("seed", DT), "seed", SCHEMA)
    files = {night: _write(table, night, f"run-{i}", parts=1) for i, night in enumerate(nights)}
    start = threading.Barrier(len(nights))

    def commit(i: int, night: delta_tables.Night) -> delta_tables.NightCommit:
        start.wait()
        return predictions_table.commit_night(table, files[night], night, f"run-{i}", SCHEMA, max_attempts=5)

    with ThreadPoolExecutor(len(nights)) as pool:
        results = list(pool.map(commit, range(len(nights)), nights))
    first = 2 if table_exists else 1  # after the creation, and the seed's commit when there is one
    assert sorted(r.version for r in results) == list(range(first, first + len(nights))), "one creation, then nights"
    assert not any(r.replaced or r.already_committed for r in results)
    for i, night in enumerate(nights):
        assert _labels(prediction_reads.read_night(table, night.model_name, night.dt)) == {f"run-{i}"}
    assert _everything(table).num_rows == 4 * len(nights)
    creations = [c for c in DeltaTable(table).history() if c["operation"] == "CREATE TABLE"]
    assert len(creations) == 1, f"a losing creation committed again (a new table id for outside readers): {creations}"


@pytest.mark.parametrize("night_exists", [False, True], ids=["first-commit", "rerun"])
def test_three_runs_of_the_same_night_one_wins_the_others_are_told(table: str, night_exists: bool) -> None:
    night = delta_tables.Night("resnet", DT)
    if night_exists:
        predictions_table.commit_night(table, _write(table, night, "run-old"), night, "run-old", SCHEMA)
    else:
        predictions_table.commit_night(table, [], delta_tables.Night("other", DT), "seed", SCHEMA)
    seen = predictions_table.night_seq(table, night)  # all three started before any of them committed
    runs = ["run-x", "run-y", "run-z"]
    files = {run: _write(table, night, run) for run in runs}
    start = threading.Barrier(len(runs))

    def commit(run: str) -> delta_tables.NightCommit | NightCommittedElsewhere:
        start.wait()
        try:
            return predictions_table.commit_night(table, files[run], night, run, SCHEMA, expected_seq=seen)
        except NightCommittedElsewhere as exc:
            return exc

    with ThreadPoolExecutor(len(runs)) as pool:
        outcomes = dict(zip(runs, pool.map(commit, runs), strict=True))
    winners = [run for run, out in outcomes.items() if isinstance(out, delta_tables.NightCommit)]
    assert len(winners) == 1, outcomes
    rows = prediction_reads.read_night(table, "resnet", DT)
    assert _labels(rows) == set(winners) and rows.num_rows == 8  # one row per input, once
    for run, out in outcomes.items():
        if run not in winners:
            assert isinstance(out, NightCommittedElsewhere)
            assert out.winner_run_id == winners[0]
            assert "another run committed that night" in str(out)
    # the losers' files are still there (no run deletes another's), just not committed
    loser_files = [f for run in runs if run not in winners for f in files[run]]
    assert all(os.path.exists(f) for f in loser_files)


def test_same_night_without_expected_seq_still_ends_with_one_run(table: str) -> None:
    """Snapshots taken at commit time: a run may replace an earlier one, but rows never double."""
    night = delta_tables.Night("resnet", DT)
    predictions_table.commit_night(table, [], delta_tables.Night("other", DT), "seed", SCHEMA)
    runs = [f"run-{i}" for i in range(4)]
    files = {run: _write(table, night, run) for run in runs}
    start = threading.Barrier(len(runs))

    def commit(run: str) -> delta_tables.NightCommit | NightCommittedElsewhere:
        start.wait()
        try:
            return predictions_table.commit_night(table, files[run], night, run, SCHEMA)
        except NightCommittedElsewhere as exc:
            return exc

    with ThreadPoolExecutor(len(runs)) as pool:
        outcomes = list(pool.map(commit, runs))
    rows = prediction_reads.read_night(table, "resnet", DT)
    last = delta_tables.night_commit(table, "resnet", DT)
    assert last is not None and _labels(rows) == {last.run_id} and rows.num_rows == 8
    committed = sorted(o.version for o in outcomes if isinstance(o, delta_tables.NightCommit))
    assert committed and last.version == committed[-1] and last.night_seq == len(committed)


def test_new_column_reads_as_null_for_an_old_night(table: str) -> None:
    old, new = delta_tables.Night("resnet", "2026-11-01"), delta_tables.Night("resnet", "2026-11-02")
    predictions_table.commit_night(table, _write(table, old, "run-a"), old, "run-a", SCHEMA)
    wider = SCHEMA.append(pa.field("latency_ms", pa.float64()))
    part = _rows("run-b").append_column("latency_ms", pa.array([1.5] * 4))
    uri = predictions_table.write_data_file(table, new, "run-b", 0, part)
    predictions_table.commit_night(table, [uri], new, "run-b", wider)
    assert prediction_reads.read_night(table, "resnet", "2026-11-01").column("latency_ms").null_count == 8
    assert prediction_reads.read_night(table, "resnet", "2026-11-02").column("latency_ms").to_pylist() == [1.5] * 4
    assert predictions_table.add_columns_if_missing(table, wider) == []
    with pytest.raises(ConfigError, match="cannot change type"):
        predictions_table.add_columns_if_missing(table, SCHEMA.set(2, pa.field("score", pa.string())))


def test_uncommitted_files_are_invisible_and_vacuum_removes_them_keeping_committed(table: str) -> None:
    night = delta_tables.Night("resnet", DT)
    first = predictions_table.commit_night(table, _write(table, night, "run-a"), night, "run-a", SCHEMA)
    predictions_table.commit_night(table, _write(table, night, "run-b"), night, "run-b", SCHEMA)
    stray = _write(table, night, "run-crashed", parts=1)  # a run that died before committing
    assert _everything(table).num_rows == 8
    assert _labels(_everything(table)) == {"run-b"}

    # files this young are a running night's: the default retention leaves them
    assert prediction_reads.vacuum(table, dry_run=False) == []
    with pytest.raises(ConfigError, match="still being written"):
        prediction_reads.vacuum(table, retention_hours=0)

    listed = prediction_reads.vacuum(
        table, retention_hours=0, allow_short_retention=True, keep_versions=[first.version]
    )
    assert listed == [os.path.relpath(stray[0], table)]  # run-a's files stay for version `first`
    assert os.path.exists(stray[0])  # a dry run by default
    prediction_reads.vacuum(
        table, retention_hours=0, allow_short_retention=True, keep_versions=[first.version], dry_run=False
    )
    assert not os.path.exists(stray[0])
    assert _labels(prediction_reads.read_night(table, "resnet", DT)) == {"run-b"}
    assert _labels(prediction_reads.read_night(table, "resnet", DT, version=first.version)) == {"run-a"}

    removed = prediction_reads.vacuum(table, retention_hours=0, allow_short_retention=True, dry_run=False)
    assert len(removed) == 2 and all("part-run-a-" in path for path in removed)
    assert _labels(prediction_reads.read_night(table, "resnet", DT)) == {"run-b"}


def test_files_outside_the_night_folder_or_bad_names_are_refused(table: str) -> None:
    night = delta_tables.Night("resnet", DT)
    elsewhere = _write(table, delta_tables.Night("resnet", "2026-11-28"), "run-a", parts=1)
    with pytest.raises(InputDataError, match="is not under"):
        predictions_table.commit_night(table, elsewhere, night, "run-a", SCHEMA)
    with pytest.raises(InputDataError, match="model name"):
        delta_tables.Night("../x", DT)
    with pytest.raises(InputDataError, match="ISO date"):
        delta_tables.Night("resnet", "yesterday")
    with pytest.raises(InputDataError, match="no Delta table"):
        prediction_reads.read_night(table + "-missing", "resnet", DT)


def test_storage_options_for_s3_come_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint and region, and the one retry and timeout policy in delta-rs's names."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("RAYLINE_STORAGE_MAX_ATTEMPTS", "4")
    monkeypatch.setenv("RAYLINE_STORAGE_TIMEOUT_S", "30")
    assert delta_tables.storage_options("s3://bucket/predictions") == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "eu-west-1",
        "max_retries": "3",
        "timeout": "30s",
        "connect_timeout": "10s",
    }
    assert delta_tables.storage_options("/tmp/x") is None


def _commit_run(root: str, night: delta_tables.Night, run: str, kind: str) -> delta_tables.NightCommit:
    """One of a nightly run's two commits (``kind``: errors or predictions), as the run makes it."""
    table = layout.table_uri(root, layout.ERRORS_TABLE if kind == "errors" else layout.PREDICTIONS_TABLE)
    seq = predictions_table.night_seq(table, night)
    return predictions_table.commit_night(
        table, _write(table, night, run, parts=1), night, run, SCHEMA, expected_seq=seq
    )


def errors_landed_predictions_raised(root: str, night: delta_tables.Night, how: str) -> str:
    """A night whose last run committed its errors and then failed to commit its predictions; the paired run.

    ``commit-failed``: run-a commits both tables, run-b its errors, then its predictions file is lost and the
    commit raises. ``another-run-won``: run-a commits both, run-c its errors, run-b (started after that) its
    errors, then run-c its predictions, so run-b's predictions commit is refused. Either way the predictions
    night pairs with errors rows that a later errors commit replaced.
    """
    predictions = layout.table_uri(root, layout.PREDICTIONS_TABLE)
    for kind in ("errors", "predictions"):
        _commit_run(root, night, "run-a", kind)
    if how == "commit-failed":
        _commit_run(root, night, "run-b", "errors")
        lost = predictions_table.write_data_file(predictions, night, "run-b", 0, _rows("run-b"))
        fs, path = storage.arrow_filesystem(lost)
        fs.delete_file(path)  # lost before the commit: its footer cannot be read
        with pytest.raises(StorageError, match="read the footer"):
            predictions_table.commit_night(predictions, [lost], night, "run-b", SCHEMA, expected_seq=1)
        return "run-a"
    seen_by_b = predictions_table.night_seq(predictions, night)
    _commit_run(root, night, "run-c", "errors")
    _commit_run(root, night, "run-b", "errors")
    _commit_run(root, night, "run-c", "predictions")
    with pytest.raises(NightCommittedElsewhere, match="run-c committed"):
        files = _write(predictions, night, "run-b", parts=1)
        predictions_table.commit_night(predictions, files, night, "run-b", SCHEMA, expected_seq=seen_by_b)
    return "run-c"


@pytest.mark.parametrize("how", ["commit-failed", "another-run-won"])
def test_vacuum_keeps_the_errors_a_current_predictions_night_pairs_with(tmp_path: Path, how: str) -> None:
    root = str(tmp_path)
    night = delta_tables.Night("resnet", DT)
    paired = errors_landed_predictions_raised(root, night, how)
    errors = layout.table_uri(root, layout.ERRORS_TABLE)
    before = prediction_reads.read_night_pair(root, "resnet", DT)

    removed = {
        name: prediction_reads.vacuum(
            layout.table_uri(root, name), retention_hours=0, allow_short_retention=True, dry_run=False
        )
        for name in (layout.PREDICTIONS_TABLE, layout.ERRORS_TABLE)
    }
    pair = prediction_reads.read_night_pair(root, "resnet", DT)
    assert _labels(pair.predictions) == _labels(pair.errors) == {paired}
    assert pair.errors_version == before.errors_version and pair.errors.num_rows == 4
    # only the paired version is kept: what no version in use needs still goes
    assert not any(f"part-{paired}-" in path for path in removed[layout.ERRORS_TABLE])
    if how == "another-run-won":
        assert [p for p in removed[layout.ERRORS_TABLE] if "part-run-a-" in p]

    # once a rerun pairs the night again, the vacuum deletes what it had kept
    for kind in ("errors", "predictions"):
        _commit_run(root, night, "run-d", kind)
    again = prediction_reads.vacuum(errors, retention_hours=0, allow_short_retention=True, dry_run=False)
    assert any(f"part-{paired}-" in path for path in again)
    assert _labels(prediction_reads.read_night_pair(root, "resnet", DT).errors) == {"run-d"}
