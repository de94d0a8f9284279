"""The predictions tables as outside readers and concurrent writers see them (issue 12).

Real nights from ``batch_inference.run`` on the session's Ray cluster (a few
dozen digits and broken images, one actor), read back the way people outside
rayline read a Delta table: ``deltalake`` to pyarrow and to pandas in a
process of their own (``delta_reader``), ``ray.data.read_delta``, and
rayline's own readers; after a rerun, at an older version (time travel); after
a driver killed between its actors' writes and its commit (``night_driver``),
and after the vacuum of that driver's orphans. Then writers at once (other
nights and models; three runs of one night), a night and its rerun on the
S3-protocol server, and a column that a later night's files add. Each checks
rows and outcomes, never timing: exactly one row per input across
``predictions`` and ``prediction_errors``, from the run that committed the
night.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import ray
from deltalake import DeltaTable

from ray_workloads import batch_inference
from ray_workloads.batch_inference import InferenceConfig, InferenceResult, new_run_id
from ray_workloads.night_blocks import listing_staging_uri
from rayline import storage
from rayline.errors import NightCommittedElsewhere, StorageError
from rayline.models.registry import ModelVersion
from rayline.seed import corrupt_objects, digit_objects
from rayline.storage import listing
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, table_uri
from rayline.tables.delta_tables import PARTITION_COLUMNS, Night, night_commit, storage_options, table_version
from rayline.tables.prediction_reads import read_night, read_night_pair, vacuum
from rayline.tables.predictions_table import PREDICTIONS_SCHEMA, commit_night, write_data_file
from tests.integration.helpers import PlantDuplicatedRow, PlantExtraRow, PlantMissingRow, register_untrained
from tests.integration.night_driver import kill_once_written
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

D1, D2 = "2026-11-26", "2026-11-27"
KINDS = ("predictions", "errors")


@dataclass(frozen=True)
class Inputs:
    """The module's models and its one night of arrivals (digits and broken images)."""

    digits: ModelVersion
    other: ModelVersion  # a second model, for two models' nights of one day
    uri: str
    expected: frozenset[str]


def _seed(uri: str, digits: int, corrupt: int) -> frozenset[str]:
    """``digits`` real digits and ``corrupt`` broken images under ``uri``; their URIs as listed."""
    broken = ((key, data) for key, data, _ in corrupt_objects(corrupt, 32, np.random.default_rng(0)))
    for key, data in [*islice(digit_objects(32), digits), *broken]:
        storage.write_bytes_atomic(storage.join(uri, key), data)
    return frozenset(o.uri for o in storage.list_objects(uri))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    root = tmp_path_factory.mktemp("prediction-tables")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYLINE_STORAGE", str(root / "storage"))  # the registry's home; the versions carry their URIs
        digits, other = register_untrained("digits"), register_untrained("digits-b", seed=1)
    incoming = str(root / "incoming")
    return Inputs(digits, other, incoming, _seed(incoming, digits=36, corrupt=4))


def _config(
    inputs: Inputs, tables_root: str, dt: str, label: str, model: ModelVersion | None = None, per_task: int = 8
) -> InferenceConfig:
    """A small night: one actor, blocks of ``per_task`` objects; ``label`` lands in every row's flow_run_id."""
    return InferenceConfig(
        input_uri=inputs.uri,
        tables_root=tables_root,
        dt=dt,
        model=model or inputs.digits,
        actors=1,
        objects_per_task=per_task,
        flow_run_id=label,
        code_version="test",
    )


def _tables(root: str) -> dict[str, str]:
    return {"predictions": table_uri(root, PREDICTIONS_TABLE), "errors": table_uri(root, ERRORS_TABLE)}


# ---------------------------------------------------------------- readers


@dataclass(frozen=True)
class Seen:
    """What one reader saw of a night: every row's input, per table, and the predictions' flow_run_ids."""

    reader: str
    uris: dict[str, list[str]]
    labels: set[str]


def _outside_reads(reads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.delta_reader", json.dumps(reads)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _deltalake_readers(root: str, model: str, dt: str, versions: dict[str, int | None]) -> list[Seen]:
    """The night through ``deltalake`` to pyarrow and to pandas (partition filter), in an outside process."""
    tables = _tables(root)
    reads = [{"table": tables[kind], "model_name": model, "dt": dt, "version": versions[kind]} for kind in KINDS]
    results = dict(zip(KINDS, _outside_reads(reads), strict=True))
    seen = []
    for reader in ("pyarrow", "pandas"):
        for kind in KINDS:
            assert results[kind][reader]["distinct"]["model_name"] in ([model], []), results[kind][reader]
            assert results[kind][reader]["distinct"]["dt"] in ([dt], []), results[kind][reader]
        labels = set(results["predictions"][reader]["distinct"]["flow_run_id"])
        seen.append(Seen(f"deltalake to {reader}", {k: results[k][reader]["uri"] for k in KINDS}, labels))
    return seen


def _ray_rows(table: str, model: str, dt: str, version: int | None) -> list[dict[str, Any]]:
    """The night through ``ray.data.read_delta``: it reads a version but filters no partition, so filter here."""
    dataset = ray.data.read_delta(table, version=version, storage_options=storage_options(table))
    return [row for row in dataset.take_all() if (row["model_name"], row["dt"]) == (model, dt)]


def _ray_reader(root: str, model: str, dt: str, versions: dict[str, int | None]) -> Seen:
    rows = {kind: _ray_rows(_tables(root)[kind], model, dt, versions[kind]) for kind in KINDS}
    labels = {str(row["flow_run_id"]) for row in rows["predictions"]}
    return Seen("ray.data.read_delta", {k: sorted(str(r["uri"]) for r in rows[k]) for k in KINDS}, labels)


def _rayline_reader(root: str, model: str, dt: str, version: int | None) -> Seen:
    pair = read_night_pair(root, model, dt, version)
    uris = {"predictions": pair.predictions.column("uri"), "errors": pair.errors.column("uri")}
    labels = set(pair.predictions.column("flow_run_id").to_pylist())
    return Seen("rayline read_night_pair", {k: sorted(v.to_pylist()) for k, v in uris.items()}, labels)


def _assert_readers_see(
    root: str, model: str, dt: str, expected: frozenset[str], label: str, at: InferenceResult | None = None
) -> None:
    """Every reader sees the night of the run labelled ``label``: each input once, as a prediction or an error.

    ``at``: read the tables at that run's versions (time travel), else their latest.
    """
    versions: dict[str, int | None] = {
        "predictions": at.predictions_version if at else None,
        "errors": at.errors_version if at else None,
    }
    readers = [
        *_deltalake_readers(root, model, dt, versions),
        _ray_reader(root, model, dt, versions),
        _rayline_reader(root, model, dt, versions["predictions"]),
    ]
    for seen in readers:
        predicted, errored = seen.uris["predictions"], seen.uris["errors"]
        assert len(predicted) + len(errored) == len(set(predicted) | set(errored)), f"{seen.reader}: a row twice"
        assert set(predicted) | set(errored) == expected, f"{seen.reader}: not one row per input"
        assert errored, f"{seen.reader}: the broken inputs are missing from prediction_errors"
        assert seen.labels == {label}, f"{seen.reader}: rows of runs {seen.labels}, expected {label}"


# ---------------------------------------------------------------- files on disk


def _parts(root: str, night: Night, run_id: str) -> dict[str, list[str]]:
    """The compacted files ``run_id`` wrote for ``night`` in each table, committed or not."""
    return {
        kind: sorted(str(p) for p in Path(uri, night.relative_dir).glob(f"part-{run_id}-*.parquet"))
        for kind, uri in _tables(root).items()
    }


def _written(root: str, night: Night, run_id: str) -> dict[str, list[str]]:
    """Every file a run of ``night`` left in each table: its compacted files, and block files that no run
    removed (a run removes the night's block files once its commit landed)."""
    blocks = {
        kind: [str(p) for p in Path(uri, night.relative_dir).glob("blocks-*/*/*")]
        for kind, uri in _tables(root).items()
    }
    return {kind: sorted({*paths, *blocks[kind]}) for kind, paths in _parts(root, night, run_id).items()}


def _files_of(result: InferenceResult, kind: str) -> list[str]:
    """The data files of ``result``'s commit in one table (what its version references for the night)."""
    uri = result.predictions_table if kind == "predictions" else result.errors_table
    version = result.predictions_version if kind == "predictions" else result.errors_version
    night = Night(result.model_name, result.dt)
    return [storage.normalize(u) for u in DeltaTable(uri, version=version).file_uris(night.filters)]


def _committed(root: str) -> dict[str, set[str]]:
    """The data files the latest version of each table references."""
    return {kind: set(DeltaTable(uri).file_uris()) for kind, uri in _tables(root).items()}


# ---------------------------------------------------------------- tests


def test_outside_readers_see_exactly_the_committed_night_through_a_rerun_and_a_killed_driver(
    inputs: Inputs, tmp_path: Path
) -> None:
    root = str(tmp_path / "tables")
    tables = _tables(root)
    first = batch_inference.run(_config(inputs, root, D1, "first"))
    assert (first.inputs, first.errors, first.replaced) == (40, 4, False)
    _assert_readers_see(root, "digits", D1, inputs.expected, "first")

    second = batch_inference.run(_config(inputs, root, D1, "second"))
    assert second.replaced and second.predictions_version > first.predictions_version
    _assert_readers_see(root, "digits", D1, inputs.expected, "second")
    _assert_readers_see(root, "digits", D1, inputs.expected, "first", at=first)  # time travel

    # a driver killed after its actors wrote, before it committed: its files are orphans nobody reads
    versions = {kind: table_version(uri) for kind, uri in tables.items()}
    orphans = kill_once_written(_config(inputs, root, D1, "killed", per_task=4), new_run_id(), _written)
    assert any(orphans.values()) and all(os.path.exists(p) for paths in orphans.values() for p in paths)
    assert {kind: table_version(uri) for kind, uri in tables.items()} == versions, "the killed run committed"
    commit = night_commit(tables["predictions"], "digits", D1)
    assert commit is not None and commit.run_id == second.run_id
    _assert_readers_see(root, "digits", D1, inputs.expected, "second")

    # vacuum removes exactly the orphans; the first run's files stay for its kept version
    kept = {"predictions": first.predictions_version, "errors": first.errors_version}
    for kind, uri in tables.items():
        removed = vacuum(uri, retention_hours=0, allow_short_retention=True, dry_run=False, keep_versions=[kept[kind]])
        assert sorted(os.path.join(uri, path) for path in removed) == orphans[kind]
    assert not any(os.path.exists(p) for paths in orphans.values() for p in paths)
    assert all(os.path.exists(p) for p in _files_of(first, "predictions") + _files_of(first, "errors"))
    _assert_readers_see(root, "digits", D1, inputs.expected, "second")
    _assert_readers_see(root, "digits", D1, inputs.expected, "first", at=first)


Outcome = InferenceResult | Exception


def _run_together(configs: dict[str, InferenceConfig]) -> dict[str, Outcome]:
    """Start ``batch_inference.run`` of each (run id → config) at once, in threads; each one's result or error."""
    start = threading.Barrier(len(configs))

    def run(run_id: str, config: InferenceConfig) -> Outcome:
        start.wait()
        try:
            return batch_inference.run(config, run_id=run_id)
        except Exception as exc:  # the test sorts expected refusals from the rest
            return exc

    with ThreadPoolExecutor(len(configs)) as pool:
        futures = {run_id: pool.submit(run, run_id, config) for run_id, config in configs.items()}
        return {run_id: future.result(timeout=600) for run_id, future in futures.items()}


def _labels(root: str, model: str, dt: str) -> set[str]:
    return set(read_night(_tables(root)["predictions"], model, dt).column("flow_run_id").to_pylist())


def test_concurrent_writers_commit_other_nights_and_serialise_one_night(inputs: Inputs, tmp_path: Path) -> None:
    root = str(tmp_path / "tables")
    independent = {
        new_run_id(): _config(inputs, root, D1, "digits-d1"),
        new_run_id(): _config(inputs, root, D2, "digits-d2"),
        new_run_id(): _config(inputs, root, D1, "other-d1", model=inputs.other),  # another model, same day
    }
    outcomes = _run_together(independent)
    results = [o for o in outcomes.values() if isinstance(o, InferenceResult)]
    assert len(results) == 3, outcomes
    assert len({r.predictions_version for r in results}) == 3 and not any(r.replaced for r in results)
    for result in results:
        pair = read_night_pair(root, result.model_name, result.dt)
        both = pair.predictions.column("uri").to_pylist() + pair.errors.column("uri").to_pylist()
        assert sorted(both) == sorted(inputs.expected) and pair.commit.run_id == result.run_id

    # three runs of one night at once: each ends committed or told who committed; the night holds one run
    same = {new_run_id(): _config(inputs, root, D2, f"same-{i}") for i in range(3)}
    outcomes = _run_together(same)
    unexpected = {r: o for r, o in outcomes.items() if not isinstance(o, InferenceResult | NightCommittedElsewhere)}
    assert not unexpected, unexpected
    committed = sorted(
        (o for o in outcomes.values() if isinstance(o, InferenceResult)), key=lambda r: r.predictions_version
    )
    assert committed, outcomes
    last = committed[-1]
    for run_id, outcome in outcomes.items():
        if isinstance(outcome, NightCommittedElsewhere):
            # a clear message: what happened, who won, and that this run's files stay uncommitted
            assert "another run committed that night" in str(outcome) and "stay uncommitted" in str(outcome)
            assert outcome.winner_run_id in same and outcome.winner_run_id in str(outcome), outcome
            assert run_id in str(outcome)
    # runs that commit in turn each replace the night; either way the last commit is what every reader sees
    assert [r.replaced for r in committed] == [True] * len(committed)  # D2 was committed by the first batch
    night = night_commit(_tables(root)["predictions"], "digits", D2)
    assert night is not None and night.run_id == last.run_id
    _assert_readers_see(root, "digits", D2, inputs.expected, str(same[last.run_id].flow_run_id))
    # only the last run's files are committed: a loser's compacted files (if it got that far) are not
    files = _committed(root)
    assert all(_parts(root, Night("digits", D2), last.run_id).values())
    for run_id in same:
        for kind, paths in _parts(root, Night("digits", D2), run_id).items():
            assert (files[kind] & set(paths)) == (set(paths) if run_id == last.run_id else set()), (run_id, kind)
    # the other nights are untouched
    assert _labels(root, "digits", D1) == {"digits-d1"} and _labels(root, "digits-b", D1) == {"other-d1"}


def test_a_night_and_its_rerun_on_s3_read_back_through_deltalake(inputs: Inputs, s3_storage: str) -> None:
    incoming = storage.join(s3_storage, "incoming")
    on_s3 = Inputs(inputs.digits, inputs.other, incoming, _seed(incoming, digits=20, corrupt=4))
    first = batch_inference.run(_config(on_s3, s3_storage, D1, "first"))
    second = batch_inference.run(_config(on_s3, s3_storage, D1, "second"))
    assert second.replaced and first.predictions_table == storage.join(s3_storage, PREDICTIONS_TABLE)
    # deltalake with rayline's storage options (endpoint, plain http, region) in an outside process, Ray, rayline
    _assert_readers_see(s3_storage, "digits", D1, on_s3.expected, "second")
    _assert_readers_see(s3_storage, "digits", D1, on_s3.expected, "first", at=first)


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
    table = _tables(root)["predictions"]
    old_night, new_night = Night("digits", D1), Night("digits", D2)
    old = batch_inference.run(_config(inputs, root, D1, "old"))
    before = _add_actions(table, old_night)
    uris_before = DeltaTable(table).file_uris(file_pruning_predicate=old_night.filters)
    mtimes = {path: os.stat(path).st_mtime_ns for path in _files_of(old, "predictions")}

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
    for seen in _outside_reads([{"table": table, "model_name": "digits", "dt": D1, "version": None}])[0].values():
        assert EXTRA in seen["columns"] and seen["nulls"][EXTRA] == old.predictions
    old_by_ray = _ray_rows(table, "digits", D1, None)
    assert len(old_by_ray) == old.predictions and all(row[EXTRA] is None for row in old_by_ray)

    # the old night's data files are the same files, untouched: only the schema changed in the log
    assert _add_actions(table, old_night) == before
    assert DeltaTable(table).file_uris(file_pruning_predicate=old_night.filters) == uris_before
    assert {path: os.stat(path).st_mtime_ns for path in _files_of(old, "predictions")} == mtimes

    # and today's writer, which knows nothing of the column, still commits into the wider table
    rerun = batch_inference.run(_config(inputs, root, D1, "narrow"))
    assert rerun.replaced
    again = read_night(table, "digits", D1)
    assert again.column(EXTRA).null_count == again.num_rows and set(again.column("flow_run_id").to_pylist()) == {
        "narrow"
    }
    assert read_night(table, "digits", D2).column(EXTRA).null_count == 0


def test_a_night_killed_at_60_percent_resumes_predicting_only_the_blocks_it_had_not_finished(
    inputs: Inputs, tmp_path: Path
) -> None:
    root = str(tmp_path / "tables")
    # the killed driver's lease stops being renewed: the rerun takes the night over after this ttl
    config = _config(inputs, root, D1, "killed", per_task=4).model_copy(update={"lease_ttl_s": 2.0})
    blocks = math.ceil(len(inputs.expected) / 4)
    finished = round(blocks * 0.6)
    killed = new_run_id()
    left = kill_once_written(config, killed, _written, blocks=finished)
    assert len([p for p in left["predictions"] if "/blocks-" in p]) == finished
    assert table_version(_tables(root)["predictions"]) is None, "the killed run committed"

    rerun = batch_inference.run(config.model_copy(update={"flow_run_id": "rerun"}))
    # the killed run's finished blocks are reused; only the rest (the one in flight, those not started) predicted
    assert (rerun.blocks, rerun.reused_blocks) == (blocks, finished)
    assert rerun.inputs == len(inputs.expected) and rerun.predictions + rerun.errors == rerun.inputs
    _assert_readers_see(root, "digits", D1, inputs.expected, "rerun")  # one row per input, named by its committer
    # what the killed attempt left is what a vacuum removes: the rerun took its blocks and removed them once
    # committed, and cleared its listing; nothing else is in the night's folders
    leftover = _written(root, Night("digits", D1), killed)
    for kind, uri in _tables(root).items():
        removed = vacuum(uri, retention_hours=0, allow_short_retention=True, dry_run=True)
        assert sorted(os.path.join(uri, path) for path in removed) == leftover[kind] == []
    assert not os.path.exists(listing_staging_uri(root, Night("digits", D1)))


def test_a_night_predicts_while_its_cutters_list_the_sub_prefixes_the_driver_left(
    inputs: Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past INLINE_OBJECTS the driver lists no further: the other label folders are listed by the night's
    cutters, part by part, while the first blocks are predicted; the committed night is the same."""
    monkeypatch.setattr(listing, "INLINE_OBJECTS", 5)  # the driver lists one group of 8 label folders of 10
    root = str(tmp_path / "tables")
    result = batch_inference.run(_config(inputs, root, D1, "streamed", per_task=4))
    assert result.inputs == len(inputs.expected) and result.predictions + result.errors == result.inputs
    assert result.listing_parts == 2 and result.data_files == {"predictions": 1, "errors": 1}  # g00000, g00001
    whole = listing.list_to_parts(inputs.uri, str(tmp_path / "whole"))
    assert result.input_content_hash == whole.content_hash and result.input_digest == whole.uris.encode()
    _assert_readers_see(root, "digits", D1, inputs.expected, "streamed")
    assert not os.path.exists(listing_staging_uri(root, Night("digits", D1))), "the listing's parts were left"


def test_the_result_of_a_night_stays_small_however_many_parts_and_blocks_it_has(inputs: Inputs, tmp_path: Path) -> None:
    # a part per input and a block per input: what grows with N at scale, here at N = 40
    config = _config(inputs, str(tmp_path / "tables"), D1, "small", per_task=1)
    result = batch_inference.run(config.model_copy(update={"listing_part_objects": 1}))
    assert result.listing_parts == result.blocks == len(inputs.expected)
    assert result.data_files == {"predictions": 1, "errors": 1}  # compacted: one file per table
    size = len(result.model_dump_json())
    assert size < 64 * 1024, size
    fields = result.model_dump()
    # no field holds a list that grows with the night: only counts, digests and versions
    assert all(len(v) <= 5 for examples in fields["skipped_examples"].values() for v in [examples])
    assert not [name for name, value in fields.items() if isinstance(value, list)]


@pytest.mark.parametrize("planted", [PlantMissingRow, PlantDuplicatedRow, PlantExtraRow])
def test_a_row_missing_duplicated_or_extra_in_the_written_files_refuses_the_commit(
    inputs: Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: type
) -> None:
    root = str(tmp_path / "tables")
    monkeypatch.setattr(batch_inference, "PredictorUDF", planted)
    with pytest.raises(StorageError, match="refusing to commit: the compacted files hold"):
        batch_inference.run(_config(inputs, root, D1, "planted"))
    assert {kind: table_version(uri) for kind, uri in _tables(root).items()} == {"predictions": None, "errors": None}
