"""`rayline lineage <uri>`: from a predictions partition back to raw objects with their etags.

The chain test runs the real prepare-data and nightly-inference flows on a
few dozen images; training is stood in for by its lineage record (a Ray
Train fit costs ~40 s and adds nothing to the graph), and the model version
is registered pointing at that run and the real preprocessed data.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from typer.testing import CliRunner

from flows.nightly_inference import nightly_inference
from flows.prepare_data import prepare_data
from ray_workloads.models import ModelSpec, build_model, state_dict_bytes
from rayline import lineage, registry, storage
from rayline.cli import app
from rayline.lineage import DatasetRef, LineageRecord
from rayline.lineage_graph import LineageNode, NoLineageError, build_graph, render_text
from rayline.seed import digit_objects
from tasks.common import openlineage_run, record_lineage
from tests.unit.test_openlineage import validate

DAY = "2026-11-28"


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


def _record(stage: str, inputs: list[str], outputs: list[str]) -> None:
    lineage.write_record(
        LineageRecord(
            stage=stage,
            started_at=datetime.now(UTC),
            inputs=[DatasetRef(uri=u) for u in inputs],
            outputs=[DatasetRef(uri=u) for u in outputs],
            code_version="test",
        )
    )


# --- the graph on hand-written records: matching rules, cycles, errors (no services) ---


@pytest.mark.unit
def test_folders_and_files_inside_outputs_find_their_record(local_storage: str) -> None:
    raw, out = storage.join(local_storage, "raw"), storage.join(local_storage, "out", "x")
    _record("preprocess", [raw], [storage.join(out, "manifest.json")])
    for asked in (out, out + "/", storage.join(out, "manifest.json"), storage.join(out, "train", "part-0.parquet")):
        graph = build_graph(asked)
        assert graph.stage == "preprocess" and graph.uri == storage.join(out, "manifest.json"), asked
        assert [(n.kind, n.uri) for n in graph.upstream] == [("external input", raw)]
    # a folder of several outputs lists each; a relative path is tried against the storage root
    _record("preprocess", [raw], [storage.join(local_storage, "out", "y", "manifest.json")])
    folder = build_graph("out")
    assert folder.kind == "folder" and [n.stage for n in folder.upstream] == ["preprocess", "preprocess"]


@pytest.mark.unit
def test_cycles_end_and_a_record_annotating_its_own_input_is_no_producer(local_storage: str) -> None:
    a, b = storage.join(local_storage, "a"), storage.join(local_storage, "b")
    _record("train", [a], [b])
    _record("tune", [b], [a])
    _record("serve_rollout", [b], [b])  # annotates b: must not replace train as its producer
    graph = build_graph(b)
    assert graph.stage == "train"
    (upstream_a,) = graph.upstream
    (again_b,) = upstream_a.upstream
    assert again_b.cycle and not again_b.upstream
    assert "cycle" in render_text(graph)


@pytest.mark.unit
def test_a_model_version_links_its_registration_training_run_and_data(local_storage: str) -> None:
    data = storage.join(local_storage, "preprocessed", "d", "manifest.json")
    run = storage.join(local_storage, "training", "r")
    checkpoint = storage.join(run, "checkpoint_000003")
    _record("preprocess", [storage.join(local_storage, "ingested", "i", "manifest.json")], [data])
    _record("train", [data], [checkpoint])
    version = registry.register(
        "digits",
        b"weights",
        model_spec={},
        image_spec={},
        classes=["0"],
        metrics={},
        data_manifest_uri=data,
        data_content_hash="h",
        code_version="test",
        training_run_uri=run,
    )
    _record("registry", [checkpoint, data], [version.uri])
    graph = build_graph(version.weights_uri)
    assert (graph.kind, graph.uri, graph.stage) == ("model version", version.uri, "registry")
    # the run folder (version.json) and its checkpoint (the record) are one training run
    assert [(n.kind, n.uri, n.repeated) for n in graph.upstream] == [
        ("training run", checkpoint, False),
        ("preprocessed shards", data, True),
    ]


@pytest.mark.unit
def test_an_unknown_uri_is_a_clear_error_and_exit_2(local_storage: str) -> None:
    with pytest.raises(NoLineageError, match="no lineage for"):
        build_graph(storage.join(local_storage, "nothing"))
    result = CliRunner().invoke(app, ["lineage", storage.join(local_storage, "nothing")])
    assert result.exit_code == 2 and "no lineage for" in result.output


# --- the real chain ---


@pytest.mark.integration
@pytest.mark.usefixtures("ray_session", "prefect_api")
def test_a_predictions_partition_leads_back_to_raw_objects_with_etags(local_storage: str) -> None:
    raw = _write_images(storage.join(local_storage, "raw"), 40)
    prepared = prepare_data(source_uri=storage.join(local_storage, "raw")).preprocess
    run_uri = storage.join(local_storage, "training", "digits-test")
    checkpoint = storage.join(run_uri, "checkpoint_000001")
    record_lineage(
        "train", datetime.now(UTC), [DatasetRef(uri=prepared.manifest_uri)], [DatasetRef(uri=checkpoint)], {}, None
    )
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
    partition = nightly_inference(date=DAY, actors=1).partition_uri

    graph = build_graph(partition)
    assert graph.kind == "predictions" and graph.uri == storage.join(partition, "manifest.json")
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

    text = CliRunner().invoke(app, ["lineage", partition, "--max-objects", "3"])
    assert text.exit_code == 0, text.output
    assert f"predictions  {graph.uri}" in text.output and "└── … 37 more" in text.output
    assert f"raw object  {min(raw)}  (etag {raw[min(raw)]})" in text.output
    # the installed entry point, in its own process: stdout is the JSON document alone
    done = subprocess.run(
        [sys.executable, "-m", "rayline.cli", "lineage", partition, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    tree = json.loads(done.stdout)
    assert {n["uri"]: n["etag"] for n in _json_walk(tree) if n["kind"] == "raw object"} == raw

    # the same runs as OpenLineage events: START/COMPLETE per task run, parented by the flow run
    events = [
        storage.read_json(o.uri) for o in storage.list_objects(storage.join(local_storage, "lineage", "openlineage"))
    ]
    for payload in events:
        validate(payload)
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


@pytest.mark.integration
def test_openlineage_events_land_in_an_s3_storage_root(s3_storage: str) -> None:
    with openlineage_run("ingest"):
        record_lineage(
            "ingest", datetime.now(UTC), [], [DatasetRef(uri=f"{s3_storage}/ingested/x/manifest.json")], {}, None
        )
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
