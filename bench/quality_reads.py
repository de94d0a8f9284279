"""What the monitor's labelled reading reads as nights accumulate: 30 nights stored against 3.

Two storage roots of one model (``--stored`` nights of ``--rows`` synthetic predictions, the challenger's
shadow rows on the latest ``--challenger-nights``, labels for ``--labelled`` photos a night); on each, the
bytes ``reading.labelled_reading`` of the latest ``--report`` nights reads against reading every night.
Nights are seeded by their date, so both roots hold the same rows for the nights they share. What is
counted, the target and the JSON keys: bench/README.md. Local disk only; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date, timedelta
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from deltalake.fs import DeltaStorageHandler  # noqa: E402

from bench.support.process_tree import proc_figure  # noqa: E402
from bench.support.results import emit  # noqa: E402
from bench.support.table_reads import commit_rows, night_rows  # noqa: E402
from rayline.ray_workloads.quality import labels_import, reading  # noqa: E402
from rayline.storage.layout import PREDICTIONS_TABLE, SHADOW_TABLE, table_uri  # noqa: E402
from rayline.tables.delta_tables import Night  # noqa: E402

MODEL = "digits"
CLASSES = [str(c) for c in range(10)]
LAST_NIGHT = date(2026, 12, 6)


class _CountedFile:
    """A delta-rs input file that adds every byte it returns to ``tally[key]``."""

    def __init__(self, inner: Any, tally: Counter[str], key: str) -> None:
        self._inner, self._tally, self._key = inner, tally, key

    def read(self, nbytes: int = -1) -> bytes:
        data: bytes = self._inner.read(nbytes)
        self._tally[self._key] += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def counted_reads() -> Iterator[Counter[str]]:
    """Bytes read through delta-rs's pyarrow filesystem, per table folder name (``predictions``, …)."""
    tally: Counter[str] = Counter()
    opened, made = DeltaStorageHandler.open_input_file, DeltaStorageHandler.from_table.__func__

    def from_table(cls: type, table: Any, *args: Any) -> Any:
        handler = made(cls, table, *args)
        handler._bench_table = table.table_uri().rstrip("/").rsplit("/", 1)[-1]
        return handler

    def open_input_file(self: Any, path: str) -> pa.PythonFile:
        return pa.PythonFile(_CountedFile(self._handler.open_input_file(path), tally, self._bench_table))

    DeltaStorageHandler.from_table = classmethod(from_table)
    DeltaStorageHandler.open_input_file = open_input_file
    try:
        yield tally
    finally:
        DeltaStorageHandler.from_table = classmethod(made)
        DeltaStorageHandler.open_input_file = opened


def _commit(root: str, table: str, night: Night, data: pa.Table) -> None:
    commit_rows(table_uri(root, table), night, data, f"bench-{table.replace('_', '-')}-{night.dt}")


def build(root: str, stored: int, rows: int, labelled: int, challenger_nights: int) -> None:
    """``stored`` nights up to ``LAST_NIGHT``: v1's predictions, v2's shadow rows on the latest
    ``challenger_nights``, labels of every night."""
    labels = []
    for back in range(stored - 1, -1, -1):
        night = Night(MODEL, (LAST_NIGHT - timedelta(days=back)).isoformat())
        rng = np.random.default_rng(int(night.dt.replace("-", "")))
        served = night_rows(night, rows, rng)
        shadowed = night_rows(night, rows, rng)
        shadowed = shadowed.set_column(
            shadowed.schema.get_field_index("model_version"), "model_version", pa.array([2] * rows, pa.int64())
        )
        _commit(root, PREDICTIONS_TABLE, night, served)
        if back < challenger_nights:
            _commit(root, SHADOW_TABLE, night, shadowed)  # the same photos (URIs follow the night and the row)
        truth = rng.integers(0, len(CLASSES), labelled)
        labels += [f"{uri},{label}\n" for uri, label in zip(served["uri"][:labelled].to_pylist(), truth, strict=True)]
    path = Path(root, "labels.csv")
    path.write_text("uri,label\n" + "".join(labels))
    config = labels_import.LabelsImportConfig(
        file_uri=str(path),
        root=root,
        model_name=MODEL,
        classes=CLASSES,
        key_base=f"{root}/incoming",
        selection="random",
    )
    assert labels_import.run(config).imported == len(labels)


def measure(read: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """What ``read`` returns, and the bytes it read: per table's data files, and in all (``rchar``)."""
    with counted_reads() as tally:
        before = proc_figure("rchar", "io")
        answer = read()
        everything = proc_figure("rchar", "io") - before
    return answer, {**{f"{table}_bytes": n for table, n in sorted(tally.items())}, "rchar_bytes": everything}


def _nights_bytes(figures: dict[str, int]) -> int:
    return figures.get(f"{PREDICTIONS_TABLE}_bytes", 0) + figures.get(f"{SHADOW_TABLE}_bytes", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stored", type=int, nargs=2, default=[3, 30], help="nights stored: few, many")
    parser.add_argument("--report", type=int, default=3, help="nights the monitor reports (quality_nights)")
    parser.add_argument("--rows", type=int, default=20_000, help="photos a night")
    parser.add_argument("--labelled", type=int, default=200, help="labelled photos a night")
    parser.add_argument("--challenger-nights", type=int, default=3, help="latest nights the challenger was scored on")
    args = parser.parse_args()
    figures: dict[int, dict[str, dict[str, int]]] = {}
    readings = {}
    with tempfile.TemporaryDirectory(prefix="rayline-quality-reads-") as work:
        for stored in args.stored:
            root = f"{work}/root-{stored}"
            began = time.perf_counter()
            build(root, stored, args.rows, args.labelled, args.challenger_nights)
            print(f"{stored} nights of {args.rows:,} photos ({args.labelled} labelled each) built in "
                  f"{time.perf_counter() - began:.1f} s", flush=True)  # fmt: skip
            monitor_reading = partial(reading.labelled_reading, root, MODEL, CLASSES, args.report, 1, 2)
            monitor_reading()  # once first: imports, page cache
            readings[stored], reported = measure(monitor_reading)
            _, every = measure(partial(reading.labelled_rows, root, MODEL))
            figures[stored] = {"reading": reported, "every_night": every}
            for name, f in figures[stored].items():
                print(f"  {name}: " + ", ".join(f"{k} {v:,}" for k, v in f.items()), flush=True)
    few, many = args.stored
    assert readings[few] == readings[many], "the same nights reported, with the same figures"
    assert len({q.dt for q in readings[many].nights}) == args.report
    ratios = {
        "nights_bytes_ratio": _nights_bytes(figures[many]["reading"]) / _nights_bytes(figures[few]["reading"]),
        "rchar_ratio": figures[many]["reading"]["rchar_bytes"] / figures[few]["reading"]["rchar_bytes"],
        "every_night_bytes_ratio": _nights_bytes(figures[many]["every_night"])
        / _nights_bytes(figures[few]["every_night"]),
    }
    print(f"{many} nights stored over {few}, the monitor reporting {args.report}:")
    print(f"  night tables' bytes read: {ratios['nights_bytes_ratio']:.3f} (target <= 1.25)")
    print(f"  every byte the process read: {ratios['rchar_ratio']:.3f} (the Delta logs and the labels included)")
    print(f"  reading every night instead: {ratios['every_night_bytes_ratio']:.3f}")
    result: dict[str, Any] = {**ratios, "stored": args.stored, "report": args.report, "rows": args.rows}
    for stored, ways in figures.items():
        for way, f in ways.items():
            for key, value in f.items():
                result[f"{way}_{key}_{stored}"] = value
    emit("quality_reads", result)


if __name__ == "__main__":
    main()
