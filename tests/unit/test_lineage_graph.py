"""The lineage graph on hand-written records: matching rules, cycles, nights of the Delta tables, errors.

No services: records, registry and storage on local disk, the CLI in-process. The real
chain (flows on Ray, through the Prefect API) is tests/integration/test_lineage_graph.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from rayline import lineage, storage
from rayline.cli import app
from rayline.errors import InputDataError, NoLineageError
from rayline.lineage import DatasetRef, LineageRecord
from rayline.lineage.graph import build_graph, render_text
from rayline.models import registry

pytestmark = pytest.mark.unit

DAY = "2026-11-28"


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


def test_an_unknown_uri_is_a_clear_error_and_a_refusal(local_storage: str) -> None:
    with pytest.raises(NoLineageError, match="no lineage for"):
        build_graph(storage.join(local_storage, "nothing"))
    result = CliRunner().invoke(app, ["lineage", storage.join(local_storage, "nothing")])
    assert result.exit_code == 3 and "no lineage for" in result.output


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
    assert result.exit_code == 3 and "is not a table of nights" in result.output
    result = CliRunner().invoke(app, ["lineage", table, "--model", "digits"])
    assert result.exit_code == 3 and "give --dt too" in result.output
    result = CliRunner().invoke(app, ["lineage", table, "--dt", DAY, "--model", "digits"])
    assert result.exit_code == 0 and "Delta version 3, run run-1" in result.output
