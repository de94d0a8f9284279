"""`rayline lineage <uri>`: from a night of the predictions table back to raw objects with their etags.

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
from ray_workloads.batch_inference import InferenceResult
from ray_workloads.models import ModelSpec, build_model, state_dict_bytes
from rayline import lineage, registry, storage
from rayline.cli import app
from rayline.delta_tables import NightCommit, night_commit
from rayline.errors import InputDataError
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
@pytest.mark.parametrize("recorded", [None, "https://download.example/resnet18.pth", "test://random-weights"])
def test_an_outside_model_version_leads_to_its_weights_source(local_storage: str, recorded: str | None) -> None:
    from rayline.specs import ImageSpec, ModelSpec, WeightsSource

    source = WeightsSource(uri="https://download.example/resnet18.pth", sha256="ab" * 32, size_bytes=7)
    version = registry.register(
        "photos",
        b"weights",
        model_spec=ModelSpec(arch="resnet18", num_classes=2),
        image_spec=ImageSpec(),
        classes=["a", "b"],
        metrics={},
        code_version="test",
        weights_source=source,
    )
    if recorded is not None:  # the registration's record may be missing, name the same URI, or another one
        lineage.write_record(
            LineageRecord(
                stage="registry",
                started_at=datetime.now(UTC),
                inputs=[DatasetRef(uri=recorded, content_hash="ab" * 32)],
                outputs=[DatasetRef(uri=version.uri)],
                code_version="test",
            )
        )
    graph = build_graph(version.uri)
    assert graph.kind == "model version" and graph.details["weights_source"] == source.model_dump()
    weights = [n for n in graph.upstream if n.kind == "outside weights"]
    assert [(n.uri, n.content_hash) for n in weights] == [(source.uri, source.sha256)]
    assert f"outside weights  {source.uri}  (sha256 {source.sha256})" in render_text(graph)
    others = [n.uri for n in graph.upstream if n.kind != "outside weights"]
    assert others == ([recorded] if recorded not in (None, source.uri) else [])


@pytest.mark.unit
def test_an_unknown_uri_is_a_clear_error_and_exit_2(local_storage: str) -> None:
    with pytest.raises(NoLineageError, match="no lineage for"):
        build_graph(storage.join(local_storage, "nothing"))
    result = CliRunner().invoke(app, ["lineage", storage.join(local_storage, "nothing")])
    assert result.exit_code == 2 and "no lineage for" in result.output


def _night_record(table: str, model: str, dt: str, run_id: str, version: int, inputs: list[str]) -> None:
    """What batch inference records: each table it committed, facets naming the night, run and version."""
    facets = {"model_name": model, "dt": dt, "run_id": run_id, "version": version, "files": [f"part-{run_id}-0"]}
    lineage.write_record(
        LineageRecord(
            stage="batch_inference",
            started_at=datetime.now(UTC),
            inputs=[DatasetRef(uri=u) for u in inputs],
            outputs=[DatasetRef(uri=table, facets=facets)],
            code_version="test",
        )
    )


@pytest.mark.unit
def test_each_night_is_a_node_with_its_delta_version_and_a_rerun_replaces_it(local_storage: str) -> None:
    table = storage.join(local_storage, "predictions")
    errors = storage.join(local_storage, "prediction_errors")
    incoming = storage.join(local_storage, "incoming", f"dt={DAY}")
    _night_record(table, "digits", DAY, "run-1", 3, [incoming])
    _night_record(table, "digits", DAY, "run-2", 5, [incoming])  # a rerun of the night: the latest record wins
    _night_record(table, "photos", DAY, "run-p", 4, [storage.join(local_storage, "photos-in")])
    _night_record(table, "digits", "2026-11-27", "run-0", 1, [incoming])
    _night_record(errors, "digits", DAY, "run-2", 5, [incoming])
    night = f"{table}/model_name=digits/dt={DAY}"

    for asked in (night, f"{night}/part-run-2-0.parquet"):  # the partition folder, or a file in it
        graph = build_graph(asked)
        assert (graph.kind, graph.uri, graph.stage) == ("predictions", night, "batch_inference"), asked
        assert (graph.details["delta_version"], graph.details["run_id"]) == (5, "run-2")
        assert [n.uri for n in graph.upstream] == [incoming]
    assert render_text(build_graph(night)).startswith(f"predictions  {night}  (Delta version 5, run run-2, ")
    one = build_graph(table, dt=DAY, model_name="digits")
    assert one.uri == night and one.details["delta_version"] == 5
    day = build_graph(table, dt=DAY)
    assert (day.kind, day.details) == ("folder", {"dt": DAY})
    assert [(n.details["model_name"], n.details["delta_version"]) for n in day.upstream] == [
        ("digits", 5),
        ("photos", 4),
    ]
    assert render_text(day).splitlines()[0] == f"folder  {table}  (nights of {DAY})"
    err = build_graph(errors, dt=DAY, model_name="digits")
    assert (err.kind, err.uri, err.details["delta_version"]) == (
        "prediction errors",
        f"{errors}/model_name=digits/dt={DAY}",
        5,
    )
    # relative to the storage root, as people type it
    assert build_graph("predictions", dt="2026-11-27", model_name="digits").details["run_id"] == "run-0"
    every = build_graph(table)  # the table: every night recorded in it
    assert every.kind == "folder" and len(every.upstream) == 3


@pytest.mark.unit
def test_a_date_needs_a_night_table_and_a_recorded_night(local_storage: str) -> None:
    table = storage.join(local_storage, "predictions")
    _night_record(table, "digits", DAY, "run-1", 3, [])
    with pytest.raises(NoLineageError, match="no lineage for photos's night of 2026-11-28"):
        build_graph(table, dt=DAY, model_name="photos")
    with pytest.raises(NoLineageError, match="no lineage for any model's night of 2026-11-27"):
        build_graph(table, dt="2026-11-27")
    raw = storage.join(local_storage, "raw")
    _record("ingest", [raw], [storage.join(local_storage, "ingested", "x", "manifest.json")])
    with pytest.raises(InputDataError, match="is not a table of nights"):
        build_graph(storage.join(local_storage, "ingested"), dt=DAY)
    with pytest.raises(InputDataError, match="must look like 2026-11-28"):
        build_graph(table, dt="28.11.2026")
    result = CliRunner().invoke(app, ["lineage", raw, "--dt", DAY])
    assert result.exit_code == 2 and "is not a table of nights" in result.output
    result = CliRunner().invoke(app, ["lineage", table, "--model", "digits"])
    assert result.exit_code == 2 and "give --dt too" in result.output
    result = CliRunner().invoke(app, ["lineage", table, "--dt", DAY, "--model", "digits"])
    assert result.exit_code == 0 and "Delta version 3, run run-1" in result.output


# --- the real chain ---


@pytest.mark.integration
@pytest.mark.usefixtures("ray_session", "prefect_api")
def test_a_night_names_its_delta_version_and_leads_back_to_raw_objects_with_etags(local_storage: str) -> None:
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
    night = nightly_inference(date=DAY, actors=1)
    assert isinstance(night, InferenceResult), night
    table = night.predictions_table
    partition = storage.join(table, f"model_name={night.model_name}", f"dt={night.dt}")

    # the night's partition folder: the node names the Delta version that committed it and the run
    graph = build_graph(partition)
    assert (graph.kind, graph.uri, graph.stage) == ("predictions", partition, "batch_inference")
    assert (graph.details["delta_version"], graph.details["run_id"]) == (night.predictions_version, night.run_id)
    assert night_commit(table, "digits", DAY) == NightCommit(night.run_id, night.predictions_version, 1)
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
