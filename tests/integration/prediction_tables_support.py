"""What the predictions-table tests share: the inputs (digits and broken images), a small night's
config, the outside readers of a night, a night that dies before its commit, and the files a run left on disk.

Used by ``test_prediction_tables.py`` (readers and writers) and ``test_night_at_scale.py`` (nights at
scale, on a small night). Each test module makes its own ``inputs`` fixture from :func:`make_inputs`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from deltalake import DeltaTable

from rayline import storage
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.nightly import batch_inference
from rayline.ray_workloads.nightly.batch_inference import InferenceConfig, InferenceResult
from rayline.seed import corrupt_objects, digit_objects
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, table_uri
from rayline.tables.delta_tables import Night, storage_options
from rayline.tables.prediction_reads import read_night_pair
from tests.integration.helpers import register_untrained
from tests.support import REPO_ROOT

KINDS = ("predictions", "errors")


@dataclass(frozen=True)
class Inputs:
    """The module's model and its one night of arrivals (digits and broken images)."""

    digits: ModelVersion
    uri: str
    expected: frozenset[str]


def seed_inputs(uri: str, digits: int, corrupt: int) -> frozenset[str]:
    """``digits`` real digits and ``corrupt`` broken images under ``uri``; their URIs as listed."""
    broken = ((key, data) for key, data, _ in corrupt_objects(corrupt, 32, np.random.default_rng(0)))
    for key, data in [*islice(digit_objects(32), digits), *broken]:
        storage.write_bytes_atomic(storage.join(uri, key), data)
    return frozenset(o.uri for o in storage.list_objects(uri))


def make_inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    """The model and one night of arrivals, for a test module's ``inputs`` fixture (module scope)."""
    root = tmp_path_factory.mktemp("prediction-tables")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYLINE_STORAGE", str(root / "storage"))  # the registry's home; the versions carry their URIs
        digits = register_untrained("digits")
    incoming = str(root / "incoming")
    return Inputs(digits, incoming, seed_inputs(incoming, digits=36, corrupt=4))


def night_config(
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


def tables_of(root: str) -> dict[str, str]:
    return {"predictions": table_uri(root, PREDICTIONS_TABLE), "errors": table_uri(root, ERRORS_TABLE)}


# ---------------------------------------------------------------- readers


@dataclass(frozen=True)
class Seen:
    """What one reader saw of a night: every row's input, per table, and the predictions' flow_run_ids."""

    reader: str
    uris: dict[str, list[str]]
    labels: set[str]


def outside_reads(reads: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
    tables = tables_of(root)
    reads = [{"table": tables[kind], "model_name": model, "dt": dt, "version": versions[kind]} for kind in KINDS]
    results = dict(zip(KINDS, outside_reads(reads), strict=True))
    seen = []
    for reader in ("pyarrow", "pandas"):
        for kind in KINDS:
            assert results[kind][reader]["distinct"]["model_name"] in ([model], []), results[kind][reader]
            assert results[kind][reader]["distinct"]["dt"] in ([dt], []), results[kind][reader]
        labels = set(results["predictions"][reader]["distinct"]["flow_run_id"])
        seen.append(Seen(f"deltalake to {reader}", {k: results[k][reader]["uri"] for k in KINDS}, labels))
    return seen


def ray_rows(table: str, model: str, dt: str, version: int | None) -> list[dict[str, Any]]:
    """The night through ``ray.data.read_delta``: it reads a version but filters no partition, so filter here."""
    dataset = ray.data.read_delta(table, version=version, storage_options=storage_options(table))
    return [row for row in dataset.take_all() if (row["model_name"], row["dt"]) == (model, dt)]


def _ray_reader(root: str, model: str, dt: str, versions: dict[str, int | None]) -> Seen:
    rows = {kind: ray_rows(tables_of(root)[kind], model, dt, versions[kind]) for kind in KINDS}
    labels = {str(row["flow_run_id"]) for row in rows["predictions"]}
    return Seen("ray.data.read_delta", {k: sorted(str(r["uri"]) for r in rows[k]) for k in KINDS}, labels)


def _rayline_reader(root: str, model: str, dt: str, version: int | None) -> Seen:
    pair = read_night_pair(root, model, dt, version)
    uris = {"predictions": pair.predictions.column("uri"), "errors": pair.errors.column("uri")}
    labels = set(pair.predictions.column("flow_run_id").to_pylist())
    return Seen("rayline read_night_pair", {k: sorted(v.to_pylist()) for k, v in uris.items()}, labels)


def assert_readers_see(
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


class DiedBeforeCompaction(Exception):
    pass


def _die_before_compaction(*args: object, **kwargs: object) -> None:
    raise DiedBeforeCompaction("every block written, nothing compacted or committed")


def run_dying_before_compaction(config: InferenceConfig, run_id: str | None = None) -> None:
    """Run a night in this process that dies once its actors wrote every block, before it compacts them.

    On disk, what a driver killed between its blocks and its commit leaves; its lease is released, though.
    A driver process to kill (``night_driver``) costs ~20 s more, for a cluster of its own.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_inference, "compact_checked", _die_before_compaction)
        with pytest.raises(DiedBeforeCompaction):
            batch_inference.run(config, run_id)


def part_files(root: str, night: Night, run_id: str) -> dict[str, list[str]]:
    """The compacted files ``run_id`` wrote for ``night`` in each table, committed or not."""
    return {
        kind: sorted(str(p) for p in Path(uri, night.relative_dir).glob(f"part-{run_id}-*.parquet"))
        for kind, uri in tables_of(root).items()
    }


def written_files(root: str, night: Night, run_id: str) -> dict[str, list[str]]:
    """Every file a run of ``night`` left in each table: its compacted files, and block files that no run
    removed (a run removes the night's block files once its commit landed)."""
    blocks = {
        kind: [str(p) for p in Path(uri, night.relative_dir).glob("blocks-*/*/*")]
        for kind, uri in tables_of(root).items()
    }
    return {kind: sorted({*paths, *blocks[kind]}) for kind, paths in part_files(root, night, run_id).items()}


def files_of(result: InferenceResult, kind: str) -> list[str]:
    """The data files of ``result``'s commit in one table (what its version references for the night)."""
    uri = result.predictions_table if kind == "predictions" else result.errors_table
    version = result.predictions_version if kind == "predictions" else result.errors_version
    night = Night(result.model_name, result.dt)
    return [storage.normalize(u) for u in DeltaTable(uri, version=version).file_uris(night.filters)]
