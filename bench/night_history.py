"""Night lookups against the table's history: what grows from 100 commits to 10,000.

A ``predictions`` table of ``--nights`` nights committed again and again up to ``--small`` and ``--large``
commits, its log written directly as ``commit_night`` and delta-rs write it (10,000 real commits would
take most of an hour here, and the reads measured are the log's); then each lookup, median of
``--repeats``, against scanning the whole history. Targets and JSON keys: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pyarrow as pa  # noqa: E402
from deltalake import DeltaTable  # noqa: E402

from bench.support.results import emit  # noqa: E402
from bench.support.timing import run_seconds  # noqa: E402
from rayline.tables import delta_tables  # noqa: E402
from rayline.tables.delta_tables import PARTITION_COLUMNS, TABLE_CONFIGURATION, Night, NightCommit  # noqa: E402

MODEL = "digits"
FIRST_NIGHT = date(2026, 1, 1)
CHECKPOINT_INTERVAL = 100  # delta-rs's default delta.checkpointInterval


def _night(index: int) -> Night:
    return Night(MODEL, (FIRST_NIGHT + timedelta(days=index)).isoformat())


def _file(night: Night, run_id: str) -> dict[str, Any]:
    return {"path": f"{night.relative_dir}/part-{run_id}-0.parquet", "partitionValues": night.values, "size": 4374}


def _commit_lines(version: int, night: Night, seq: int, previous_run: str | None) -> list[dict[str, Any]]:
    """One night's commit as ``commit_night`` writes it."""
    run_id = f"run-{version}"
    now = 1_780_000_000_000 + version * 1000
    info = {
        "timestamp": now,
        "operation": "WRITE",
        "operationParameters": {"mode": "Overwrite", "partitionBy": json.dumps(list(PARTITION_COLUMNS))},
        **NightCommit(
            run_id=run_id, model_name=night.model_name, dt=night.dt, night_seq=seq, files=1, rows=4
        ).to_metadata(),
    }
    add = {**_file(night, run_id), "modificationTime": now, "dataChange": True, "stats": '{"numRecords": 4}'}
    lines: list[dict[str, Any]] = [{"commitInfo": info}, {"add": add}]
    if previous_run is not None:
        remove = {**_file(night, previous_run), "dataChange": True, "deletionTimestamp": now}
        lines.append({"remove": {**remove, "extendedFileMetadata": True}})
    lines += [
        {"txn": {"appId": night.app_id, "version": seq}},
        {"txn": {"appId": night.run_app_id(run_id), "version": seq}},
    ]
    return lines


def build_table(folder: str, commits: int, nights: int) -> str:
    """A table whose ``commits`` night commits cycle over ``nights`` nights (version 0 creates it)."""
    uri = f"{folder}/predictions-{commits}"
    schema = pa.schema([("uri", pa.string()), ("model_name", pa.string()), ("dt", pa.string())])
    DeltaTable.create(uri, schema, partition_by=list(PARTITION_COLUMNS), configuration=TABLE_CONFIGURATION)
    log = Path(uri, "_delta_log")
    last_run: dict[Night, str] = {}
    for version in range(1, commits + 1):
        night = _night((version - 1) % nights)
        lines = _commit_lines(version, night, (version - 1) // nights + 1, last_run.get(night))
        (log / f"{version:020d}.json").write_text("".join(json.dumps(line) + "\n" for line in lines))
        last_run[night] = f"run-{version}"
        if version % CHECKPOINT_INTERVAL == 0:
            DeltaTable(uri, version=version).create_checkpoint()
    return uri


def median_s(read: Callable[[], object], repeats: int) -> float:
    read()  # untimed: imports, page cache
    return statistics.median(run_seconds(read, repeats))


def history_scan(uri: str) -> dict[Night, str]:
    """Every night's current run from the whole history: the rule every read followed before."""
    tbl = delta_tables.open_table(uri)
    runs: dict[Night, str] = {}
    for entry in tbl.history():
        commit = NightCommit.from_metadata(entry)
        if commit is not None and (night := Night(commit.model_name, commit.dt)) not in runs:
            runs[night] = commit.run_id
    return runs


def measure(uri: str, commits: int, nights: int, repeats: int) -> dict[str, float]:
    newest, oldest = _night((commits - 1) % nights), _night(commits % nights if commits > nights else 0)
    never = Night(MODEL, "2025-01-01")

    def current_runs() -> dict[Night, str]:
        return delta_tables.current_runs(uri, delta_tables.open_table(uri))

    def find(night: Night) -> Callable[[], object]:
        return lambda: delta_tables.find_commit(uri, delta_tables.open_table(uri), night)

    expected = history_scan(uri)
    assert current_runs() == expected, "the bounded reads and the history disagree"
    found = delta_tables.find_commit(uri, delta_tables.open_table(uri), oldest)
    assert found is not None and found.run_id == expected[oldest], found
    return {
        "open_s": median_s(lambda: delta_tables.open_table(uri), repeats),
        "current_runs_s": median_s(current_runs, repeats),
        "history_scan_s": median_s(lambda: history_scan(uri), repeats),
        "find_newest_s": median_s(find(newest), repeats),
        "find_oldest_s": median_s(find(oldest), repeats),
        "find_absent_s": median_s(find(never), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--large", type=int, default=10_000)
    parser.add_argument("--nights", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    figures: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rayline-night-history-") as folder:
        for commits in (args.small, args.large):
            began = time.perf_counter()
            uri = build_table(folder, commits, args.nights)
            print(f"{commits} commits over {args.nights} nights built in {time.perf_counter() - began:.1f} s")
            figures[commits] = measure(uri, commits, args.nights, args.repeats)
            for name, seconds in figures[commits].items():
                print(f"  {name}: {seconds * 1000:.1f} ms", flush=True)
    small, large = figures[args.small], figures[args.large]
    ratios = {f"{name.removesuffix('_s')}_ratio": large[name] / small[name] for name in small}
    print(f"at {args.large} commits vs {args.small}:")
    for name, ratio in ratios.items():
        print(f"  {name}: {ratio:.2f}")
    lookups = ("current_runs_s", "find_newest_s", "find_oldest_s", "find_absent_s")
    shares = {f"{name.removesuffix('_s')}_vs_history": large[name] / large["history_scan_s"] for name in lookups}
    print(f"at {args.large} commits, each lookup over the history scan (target <= 0.2):")
    for name, share in shares.items():
        print(f"  {name}: {share:.3f}")
    result = {
        **shares,
        "small_commits": args.small,
        "large_commits": args.large,
        "nights": args.nights,
        **ratios,
        **{f"{name}_{size}": round(value, 6) for size, f in figures.items() for name, value in f.items()},
    }
    emit("night_history", result)


if __name__ == "__main__":
    main()
