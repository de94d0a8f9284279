"""What a consumer draws from rayline's OpenLineage events: each dataset's schema as written, what a run wrote
(``outputStatistics``), a night's error budget, and the parents of runs that a deployment started.

The datasets here are real files: a Delta table committed by the night's own writer, a Parquet file; the
expected schema and sizes are read from them with pyarrow and the filesystem, not from rayline's reader.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from openlineage.client.event_v2 import RunEvent
from openlineage.client.serde import Serde

from rayline import lineage, storage
from rayline.lineage import DatasetRef, ErrorBudget, openlineage_events, openlineage_facets
from rayline.storage import layout
from rayline.tables import delta_tables, predictions_table
from rayline.tasks.common import openlineage_run, record_lineage
from tests.support import REPO_ROOT
from tests.unit.test_openlineage import Declared, _events, validate

pytestmark = pytest.mark.unit

DT = "2026-11-29"
ROWS = pa.schema(
    [
        ("image_id", pa.string()),
        ("label", pa.string()),
        ("top_k", pa.list_(pa.struct([("label", pa.string()), ("prob", pa.float32())]))),
    ]
)


def _night(root: str) -> tuple[str, delta_tables.NightCommit, list[str]]:
    """A night of 3 + 3 rows in two files, committed to a predictions table the way a night commits it."""
    table = layout.table_uri(root, layout.PREDICTIONS_TABLE)
    night = delta_tables.Night("digits", DT)
    rows = pa.table(
        {"image_id": ["a", "b", "c"], "label": ["3", "7", "3"], "top_k": [[{"label": "3", "prob": 0.9}]] * 3},
        schema=ROWS,
    )
    files = [predictions_table.write_data_file(table, night, "run-a", part, rows) for part in range(2)]
    made = predictions_table.commit_night(table, files, night, "run-a", ROWS)
    return table, made, files


def _fields(facet: dict[str, Any]) -> list[tuple[str, str, list[Any]]]:
    return [(f["name"], f["type"], _fields({"fields": f.get("fields", [])})) for f in facet["fields"]]


def test_a_night_s_tables_carry_their_schema_what_was_written_and_the_error_budget(local_storage: str) -> None:
    table, made, files = _night(local_storage)
    budget = ErrorBudget(rows=8, error_rows=2, budget=0.05)
    night = DatasetRef(uri=table, stored_as="delta", table_version=made.version, quality=budget)
    with openlineage_run("batch-inference"):
        record_lineage("batch_inference", Declared([], [night]), {})

    complete = next(e for e in _events(local_storage) if e["eventType"] == "COMPLETE")
    validate(complete)
    (output,) = complete["outputs"]
    # the schema as Delta holds it (partition columns included), nested fields of the list of structs named
    schema = pa.schema(DeltaTable(table, version=made.version).schema().to_arrow())
    assert [f["name"] for f in output["facets"]["schema"]["fields"]] == schema.names
    top_k = next(f for f in output["facets"]["schema"]["fields"] if f["name"] == "top_k")
    assert top_k["type"].startswith("list<") and [f["name"] for f in top_k["fields"]] == ["label", "prob"]
    # what the commit wrote: its two files, by their sizes on disk and their rows
    sizes = sum(os.path.getsize(storage.normalize(f)) for f in files)
    stats = output["outputFacets"]["outputStatistics"]
    assert (stats["rowCount"], stats["size"], stats["fileCount"]) == (6, sizes, 2)
    assert output["facets"]["version"]["datasetVersion"] == str(made.version)
    quality = output["facets"][openlineage_facets.ERROR_BUDGET_FACET]
    assert (quality["rows"], quality["errorRows"], quality["errorFraction"], quality["withinBudget"]) == (
        8,
        2,
        0.25,
        False,
    )
    shipped = json.loads((REPO_ROOT / "docs" / "openlineage" / "ErrorBudgetDatasetFacet.json").read_text())
    assert quality["_schemaURL"] == shipped["$id"]
    jsonschema.validate(quality, shipped["$defs"]["ErrorBudgetDatasetFacet"]["allOf"][1])
    # the lineage record keeps what was read back
    (record,) = lineage.read_records("batch_inference")
    assert record.outputs[0].written and record.outputs[0].written.files == 2


def test_an_input_carries_its_schema_and_no_statistics(local_storage: str, tmp_path: Path) -> None:
    answers = tmp_path / "answers.parquet"
    pq.write_table(pa.table({"uri": ["a"], "predicted": [3]}), answers)
    written = DatasetRef(uri=str(tmp_path / "report.json"), stored_as="json")
    storage.write_json_atomic(written.uri, {"accuracy": 0.9, "per_class": [{"name": "3", "support": 4}]})
    with openlineage_run("evaluate"):
        record_lineage("evaluate", Declared([DatasetRef(uri=str(answers), stored_as="parquet")], [written]), {})
    complete = next(e for e in _events(local_storage) if e["eventType"] == "COMPLETE")
    validate(complete)
    (read,) = complete["inputs"]
    assert _fields(read["facets"]["schema"]) == [("uri", "string", []), ("predicted", "int64", [])]
    assert "inputFacets" not in read or "outputStatistics" not in read["inputFacets"]
    (report,) = complete["outputs"]
    assert _fields(report["facets"]["schema"]) == [
        ("accuracy", "number", []),
        ("per_class", "array<object>", [("name", "string", []), ("support", "integer", [])]),
    ]
    stats = report["outputFacets"]["outputStatistics"]
    assert (stats["rowCount"], stats["fileCount"], stats["size"]) == (1, 1, os.path.getsize(written.uri))


def test_what_cannot_be_read_back_is_logged_and_the_run_stands(
    local_storage: str, caplog: pytest.LogCaptureFixture
) -> None:
    gone = DatasetRef(uri=storage.join(local_storage, "nowhere.parquet"), stored_as="parquet")
    with openlineage_run("evaluate"):
        record_lineage("evaluate", Declared([], [gone]), {})
    complete = next(e for e in _events(local_storage) if e["eventType"] == "COMPLETE")
    (output,) = complete["outputs"]
    assert "schema" not in output["facets"] and "nowhere.parquet" in caplog.text
    assert lineage.read_records("evaluate")[0].outputs[0].written is None


def test_a_deployment_s_schedule_or_trigger_is_a_flow_run_s_parent_run() -> None:
    flow_run = "0190a8b2-1111-7222-8333-444455556666"
    slot = "scheduled d-1 s-1 2026-11-29T02:00:00+00:00"
    at = datetime(2026, 11, 29, 2, tzinfo=UTC)
    tick = openlineage_events.trigger_run("SCHEDULE", "s-1", "nightly", "nightly-inference/nightly", flow_run, slot, at)
    assert tick is not None and tick.job_name == "nightly-inference/nightly/schedule/nightly"
    assert tick.run_id == openlineage_events.as_run_id(slot), "one run per scheduled slot, whichever run reads it"
    fired = openlineage_events.trigger_run("AUTOMATION", "a-1", "roll out", "serve-rollout/challenger", flow_run)
    assert fired is not None and fired.job_name == "serve-rollout/challenger/trigger/roll out"
    assert openlineage_events.trigger_run(None, None, None, "serve-rollout/challenger", flow_run) is None
    assert openlineage_events.trigger_run("SCHEDULE", "s-1", "x", None, flow_run) is None, "no deployment: no parent"

    started = validate(_as_sent(openlineage_events.build_event("START", tick)))
    assert started.run.facets and started.run.facets["nominalTime"].nominalStartTime == at.isoformat()  # type: ignore[attr-defined]
    assert started.job.facets and started.job.facets["jobType"].jobType == "SCHEDULE"  # type: ignore[attr-defined]
    flow = openlineage_events.RunIdentity(
        run_id=flow_run, job_name="nightly-inference", job_type="FLOW", parent_run_id=tick.run_id,
        parent_job_name=tick.job_name,
    )  # fmt: skip
    event = validate(_as_sent(openlineage_events.build_event("START", flow)))
    assert event.run.facets and event.run.facets["parent"].run.runId == tick.run_id  # type: ignore[attr-defined]
    assert event.run.facets["processing_engine"].name == "Prefect"  # type: ignore[attr-defined]


def _as_sent(event: RunEvent) -> dict[str, Any]:
    """The event as a transport sends it (the client's own serialisation)."""
    return dict(json.loads(Serde.to_json(event)))
