"""Reading one night from a predictions table that holds many (``--parts table``): does it cost one night?

A ``predictions`` Delta table filled as nightly inference fills it, without Ray or a model (synthetic rows
of the real columns in part files of ``ROWS_PER_FILE``, one commit a night), then ``read_night`` of night 1
while it holds one night against the newest once it holds ``nights``. What grows is the log to replay; the
files read stay one night's. Also the synthetic tables of bench/quality_reads.py and shadow_memory.py.
"""

from __future__ import annotations

import statistics
import time
from datetime import date, timedelta

import numpy as np
import pyarrow as pa

from bench.support.timing import run_seconds
from rayline.storage.layout import PREDICTIONS_TABLE, table_uri
from rayline.tables.delta_tables import Night
from rayline.tables.prediction_reads import read_night
from rayline.tables.predictions_table import PREDICTIONS_SCHEMA, commit_night, write_data_file

MODEL = "digits"
# what an actor writes per block for small images (batch_inference.objects_per_task): one file each
ROWS_PER_FILE = 256
TOP_K = 3
CLASSES = np.array([str(c) for c in range(10)], dtype=object)
FIRST_NIGHT = date(2026, 11, 1)


def predictions_table(
    uris: list[str],
    etags: list[str],
    top: np.ndarray,
    probs: np.ndarray,
    classes: np.ndarray,
    inference_ms: np.ndarray,
    version: int,
    plan: str,
) -> pa.Table:
    """Prediction rows with the table's real columns: the ``top`` class indices of each row and their ``probs``."""
    rows, top_k = top.shape
    offsets = pa.array(np.arange(0, rows * top_k + 1, top_k, dtype=np.int32))
    columns = {
        "uri": pa.array(uris),
        "etag": pa.array(etags),
        "predicted_index": pa.array(top[:, 0], pa.int64()),
        "predicted_class": pa.array(classes[top[:, 0]]),
        "confidence": pa.array(probs[:, 0], pa.float32()),
        "top_k_index": pa.ListArray.from_arrays(offsets, pa.array(top.ravel(), pa.int64())),
        "top_k_prob": pa.ListArray.from_arrays(offsets, pa.array(probs.ravel(), pa.float64())),
        "top_k_class": pa.ListArray.from_arrays(offsets, pa.array(classes[top.ravel()])),
        "inference_ms": pa.array(inference_ms, pa.float32()),
        "model_version": pa.array(np.full(rows, version, dtype=np.int64)),
        "code_version": pa.array(["bench"] * rows),
        "flow_run_id": pa.array([""] * rows),
        "plan": pa.array([plan] * rows),
    }
    return pa.table(columns, schema=PREDICTIONS_SCHEMA)


def night_rows(night: Night, rows: int, rng: np.random.Generator) -> pa.Table:
    """``rows`` synthetic predictions of ``night`` by version 1 (10 classes, top 3)."""
    top = np.argsort(rng.random((rows, 10)), axis=1)[:, :TOP_K]
    probs = np.sort(rng.random((rows, TOP_K)), axis=1)[:, ::-1]
    uris = [f"s3://bench/incoming/dt={night.dt}/{i % 10}/image-{i:07d}.png" for i in range(rows)]
    etags = [f"{i:032x}" for i in range(rows)]
    return predictions_table(
        uris, etags, top, probs, CLASSES, rng.uniform(0.5, 2.0, rows), 1, "eager/fp32/channels-last"
    )


def commit_rows(table: str, night: Night, data: pa.Table, run_id: str) -> None:
    """``data`` as a run commits a night: part files of ``ROWS_PER_FILE`` rows in its folder, then one commit."""
    parts = [
        write_data_file(table, night, run_id, part, data.slice(start, ROWS_PER_FILE))
        for part, start in enumerate(range(0, data.num_rows, ROWS_PER_FILE))
    ]
    commit_night(table, parts, night, run_id, PREDICTIONS_SCHEMA)


def median_read_s(table: str, night: Night, rows: int, repeats: int) -> float:
    """Median seconds of ``read_night`` of ``night`` (one untimed read first: imports, page cache)."""
    assert read_night(table, night.model_name, night.dt).num_rows == rows
    return statistics.median(run_seconds(lambda: read_night(table, night.model_name, night.dt), repeats))


def bench_table(work: str, nights: int, rows: int, repeats: int) -> dict[str, float]:
    """read_night of night 1 in a 1-night table vs of night ``nights`` in a ``nights``-night table."""
    table = table_uri(f"{work}/table-reads", PREDICTIONS_TABLE)
    rng = np.random.default_rng(0)
    all_nights = [Night(MODEL, (FIRST_NIGHT + timedelta(days=i)).isoformat()) for i in range(nights)]
    commit_rows(table, all_nights[0], night_rows(all_nights[0], rows, rng), f"bench-{all_nights[0].dt}")
    first_s = median_read_s(table, all_nights[0], rows, repeats)
    began = time.perf_counter()
    for night in all_nights[1:]:
        commit_rows(table, night, night_rows(night, rows, rng), f"bench-{night.dt}")
    built_s = time.perf_counter() - began
    last_s = median_read_s(table, all_nights[-1], rows, repeats)
    ratio = last_s / first_s
    per_night = -(-rows // ROWS_PER_FILE)
    print(f"predictions table, read_night of a night of {rows} rows in {per_night} files, median of {repeats}:")
    print(f"  night 1 of a 1-night table: {first_s * 1000:.1f} ms")
    print(f"  night {nights} of a {nights}-night table: {last_s * 1000:.1f} ms ({nights * per_night} files in the log)")
    print(f"  ratio {ratio:.2f} (target <= 2: a night's read stays that of one night)")
    print(f"  (the other {nights - 1} nights were written and committed in {built_s:.2f}s)", flush=True)
    return {"read_night1_s": first_s, "read_night30_s": last_s, "read_night30_vs_1": ratio}
