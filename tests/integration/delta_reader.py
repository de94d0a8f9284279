"""An outside reader of a night: the ``deltalake`` package alone, in a process of its own.

``python -m tests.integration.delta_reader '<JSON list of reads>'``; each read is
``{"table": uri, "model_name": m, "dt": d, "version": n or null}``. For each,
the night is read twice, as a user of the table would: to pyarrow and to
pandas, each with a filter on the partition columns; one line of JSON comes
out, a list with, per read and reader, the rows' ``uri`` values, the column
names, the distinct values of the partition columns and of ``flow_run_id``
(predictions only), and the null count of every column.

Why a process: that is where outside readers live, and its exit is abrupt
(``os._exit``) because Arrow's scanner threads over a Delta dataset sometimes
outlive the interpreter and abort it at exit (see ``read_night``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable

from rayline.tables.delta_tables import storage_options

# columns whose distinct values a test compares (besides the uris)
DISTINCT = ("model_name", "dt", "flow_run_id")


def _summary(rows: pa.Table) -> dict[str, Any]:
    return {
        "uri": sorted(str(u) for u in rows.column("uri").to_pylist()),
        "columns": sorted(rows.column_names),
        "distinct": {
            name: sorted(set(rows.column(name).to_pylist())) for name in DISTINCT if name in rows.column_names
        },
        "nulls": {name: rows.column(name).null_count for name in rows.column_names},
    }


def read(spec: dict[str, Any]) -> dict[str, Any]:
    table = DeltaTable(spec["table"], version=spec.get("version"), storage_options=storage_options(spec["table"]))
    night = [("model_name", "=", spec["model_name"]), ("dt", "=", spec["dt"])]
    arrow = table.to_pyarrow_table(filters=night)
    frame = table.to_pandas(filters=night)
    # back to Arrow only to summarise alike: a null float that pandas holds as NaN counts as null again
    return {"pyarrow": _summary(arrow), "pandas": _summary(pa.Table.from_pandas(frame, preserve_index=False))}


def main(argv: list[str]) -> None:
    results = [read(spec) for spec in json.loads(argv[0])]
    sys.stdout.write(json.dumps(results) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
