"""`rayline lineage <uri>`: from a night of the predictions table back to raw objects with their etags.

The chain test runs the real prepare-data and nightly-inference flows on a
few dozen images; training is stood in for by its lineage record (a Ray
Train fit costs ~40 s and adds nothing to the graph), and the model version
is registered pointing at that run and the real preprocessed data. The
graph's rules on hand-written records, which need no service, are unit tests
(tests/unit/test_lineage_graph.py).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from rayline import lineage, storage
from rayline.cli import app
from rayline.flows.nightly_inference import NightRequest, nightly_inference
from rayline.flows.prepare_data import PrepareRequest, prepare_data
from rayline.lineage import DatasetRef, openlineage_events, openlineage_facets
from rayline.lineage.graph import LineageNode, build_graph, render_text
from rayline.models import registry
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
from rayline.ray_workloads.nightly.batch_inference import InferenceResult
from rayline.ray_workloads.nightly.request import NightShape
from rayline.seed import digit_objects
from rayline.tables.delta_tables import night_commit
from rayline.tasks.common import openlineage_run, record_lineage
from tests.lineage_support import assert_drawable, stored_events, wait_for_materializations
from tests.unit.test_lineage_graph import DAY, _record
from tests.unit.test_openlineage import Declared, validate
from tests.unit.test_predictions_table import found

pytestmark = pytest.mark.integration


def _walk(node: LineageNode) -> Iterator[LineageNode]:
    yield node
    for child in node.upstream:
        yield from _walk(child)


def _json_walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node["upstream"]:
        yield from _json_walk(child)


def _write_images(prefix: str, count: int) -> dict[str, str]:
    """``count`` digits under ``prefix``; returns uri → etag as listed."""
    for key, data in itertools.islice(digit_objects(32), count):
        storage.write_bytes_atomic(storage.join(prefix, key), data)
    return {o.uri: o.etag for o in storage.list_objects(prefix)}


@pytest.mark.usefixtures("ray_session")
def test_a_night_names_its_delta_version_and_leads_back_to_raw_objects_with_etags(
    local_storage: str, prefect_api: str
) -> None:
    raw = _write_images(storage.join(local_storage, "raw"), 40)
    prepared = prepare_data(PrepareRequest(source_uri=storage.join(local_storage, "raw"))).preprocess
    run_uri = storage.join(local_storage, "training", "digits-test")
    checkpoint = storage.join(run_uri, "checkpoint_000001")
    record_lineage("train", Declared([DatasetRef(uri=prepared.manifest_uri)], [DatasetRef(uri=checkpoint)]), {})
    spec = ModelSpec(num_classes=len(prepared.classes), width=8)
    version = registry.register(
        "digits",
        state_dict_bytes(build_model(spec)),
        model_spec=spec.model_dump(),
        image_spec=prepared.image.model_dump(),
        classes=prepared.classes,
        metrics={"test_accuracy": 0.1},
        data_manifest_uri=prepared.manifest_uri,
        data_content_hash=prepared.input_content_hash,
        code_version="test",
        training_run_uri=run_uri,
    )
    registry.set_alias("digits", registry.CHAMPION, version.version, "test")
    _write_images(storage.join(local_storage, "incoming", f"dt={DAY}"), 12)
    night = nightly_inference(NightRequest(date=DAY, shape=NightShape(actors=1)))
    assert isinstance(night, InferenceResult), night
    table = night.predictions_table
    partition = storage.join(table, f"model_name={night.model_name}", f"dt={night.dt}")

    # the night's partition folder: the node names the Delta version that committed it and the run
    graph = build_graph(partition)
    assert (graph.kind, graph.uri, graph.stage) == ("predictions", partition, "batch_inference")
    assert (graph.details["delta_version"], graph.details["run_id"]) == (night.predictions_version, night.run_id)
    assert found(night_commit(table, "digits", DAY)) == (night.run_id, night.predictions_version, 1)
    kinds = [n.kind for n in _walk(graph)]
    for kind in ("model version", "training run", "preprocessed shards", "ingested shards", "raw objects"):
        assert kind in kinds, (kind, render_text(graph))
    model = next(n for n in graph.upstream if n.kind == "model version")
    assert model.uri == version.uri and model.details["version"] == version.version
    chain = [model, model.upstream[0], model.upstream[0].upstream[0], model.upstream[0].upstream[0].upstream[0]]
    assert [n.kind for n in chain] == ["model version", "training run", "preprocessed shards", "ingested shards"]
    assert chain[1].uri == checkpoint
    assert any(n.repeated for n in model.upstream), "the data manifest shows once, expanded under the training run"
    objects = {n.uri: n.etag for n in _walk(graph) if n.kind == "raw object"}
    assert objects == raw

    # the table and a day: the day's nights (digits' only), each walked upstream
    text = CliRunner().invoke(app, ["lineage", table, "--dt", DAY, "--max-objects", "3"])
    assert text.exit_code == 0, text.output
    assert text.output.startswith(f"folder  {table}  (nights of {DAY})")
    label = f"predictions  {partition}  (Delta version {night.predictions_version}, run {night.run_id}, "
    assert label in text.output and f"model version  {version.uri}" in text.output
    assert "└── … 37 more" in text.output
    assert f"raw object  {min(raw)}  (etag {raw[min(raw)]})" in text.output
    # one model's night, by the installed entry point in its own process: stdout is the JSON document alone
    done = subprocess.run(
        [sys.executable, "-m", "rayline.cli", "lineage", table, "--dt", DAY, "--model", "digits", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    tree = json.loads(done.stdout)
    assert (tree["uri"], tree["details"]["delta_version"]) == (partition, night.predictions_version)
    assert {n["uri"]: n["etag"] for n in _json_walk(tree) if n["kind"] == "raw object"} == raw

    # the same runs as OpenLineage events: START/COMPLETE per task run, parented by the flow run
    events = stored_events(local_storage)  # each validated against the client's event model
    by_job = {(e["job"]["name"], e["eventType"]) for e in events}
    for job in ("ingest", "preprocess", "batch-inference"):
        assert {(job, "START"), (job, "COMPLETE")} <= by_job, by_job
    (inference_record,) = lineage.read_records("batch_inference")
    complete = next(e for e in events if e["job"]["name"] == "batch-inference" and e["eventType"] == "COMPLETE")
    assert complete["run"]["runId"] == inference_record.run.task_run_id
    assert complete["run"]["facets"]["parent"]["run"]["runId"] == inference_record.run.flow_run_id
    assert {i["name"] for i in complete["inputs"]} == {
        storage.join(local_storage, "incoming", f"dt={DAY}"),
        version.weights_uri,
    }
    _assert_drawable(events, night)
    _assert_materialized(prefect_api, night, prepared.manifest_uri)


def _assert_drawable(events: list[dict[str, Any]], night: InferenceResult) -> None:
    """The flow runs are runs of their own and the parents of the stages' runs; the night's tables, with what was
    written and the night's error budget."""
    assert_drawable(events, ("prepare-data", "nightly-inference"), stood_in=("train",))
    parents = {e["run"]["facets"]["parent"]["job"]["name"] for e in events if "parent" in e["run"]["facets"]}
    assert parents == {"prepare-data", "nightly-inference"}
    outputs = [o for e in events if e["eventType"] == "COMPLETE" for o in e["outputs"]]
    table = next(o for o in outputs if o["name"] == openlineage_events.dataset_id(night.predictions_table)[1])
    assert table["outputFacets"]["outputStatistics"]["rowCount"] == night.predictions
    budget = table["facets"][openlineage_facets.ERROR_BUDGET_FACET]
    assert (budget["rows"], budget["errorRows"], budget["budget"]) == (night.inputs, night.errors, 0.05)


def _assert_materialized(api: str, night: InferenceResult, manifest_uri: str) -> None:
    """The tables and folders the tasks wrote are Prefect assets under their OpenLineage URIs and names."""
    table, manifest = (openlineage_events.dataset_uri(u) for u in (night.predictions_table, manifest_uri))
    found = wait_for_materializations(api, lambda made: {table, manifest} <= set(made))
    (made,) = found[table]
    payload = made["payload"]
    assert (payload["rows"], payload["version"]) == (night.predictions, night.predictions_version), payload
    assert payload["openlineage"]["name"] == made["resource"]["prefect.resource.name"]
    assert payload["openlineage"]["name"] == openlineage_events.dataset_id(night.predictions_table)[1]
    roles = {r["prefect.resource.role"] for r in made["related"]}
    assert {"asset", "flow-run", "task-run"} <= roles, "its upstream assets and the run that made it"


def test_openlineage_events_land_in_an_s3_storage_root(s3_storage: str) -> None:
    with openlineage_run("ingest"):
        record_lineage("ingest", Declared([], [DatasetRef(uri=f"{s3_storage}/ingested/x/manifest.json")]), {})
    events = [storage.read_json(o.uri) for o in storage.list_objects(f"{s3_storage}/lineage/openlineage")]
    assert [validate(e).eventType.value for e in events if e.get("eventType")] == ["START", "COMPLETE"]
    bucket = s3_storage[len("s3://") :].split("/")[0]
    # and the graph reads records from the bucket
    _record("preprocess", [f"{s3_storage}/raw"], [f"{s3_storage}/out/x/manifest.json"])
    graph = build_graph(f"{s3_storage}/out/x")
    assert graph.stage == "preprocess" and graph.upstream[0].uri == f"{s3_storage}/raw"
    assert (events[1]["outputs"][0]["namespace"], events[1]["outputs"][0]["name"]) == (
        f"s3://{bucket}",
        "root/ingested/x/manifest.json",
    )
