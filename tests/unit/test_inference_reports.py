"""The reports batch inference's UDF returns to the driver survive the trip as a Ray Data batch."""

from __future__ import annotations

import pyarrow as pa
import pytest

from ray_workloads.inference_predictor import WrittenFile, reports

pytestmark = pytest.mark.unit


def test_written_files_round_trip_through_a_report_batch() -> None:
    written = [
        WrittenFile("predictions", "/p/run-1/predictions/part-a.parquet", 250),
        WrittenFile("errors", "/p/run-1/errors/part-a.parquet", 6, {"CorruptImageError": 4, "EmptyImageError": 2}),
    ]
    batch = pa.table(reports(written))  # what Ray Data makes of the UDF's dict of arrays
    assert [WrittenFile.from_report(row) for row in batch.to_pylist()] == written


def test_importing_the_udf_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, ray_workloads.batch_inference; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
