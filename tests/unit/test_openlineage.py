"""OpenLineage run events: built with the client's models, read back and validated against them."""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import attr
import pytest
from openlineage.client.event_v2 import RunEvent
from openlineage.client.facet_v2 import (
    BaseFacet,
    dataset_version_dataset,
    error_message_run,
    job_type_job,
    nominal_time_run,
    output_statistics_output_dataset,
    parent_run,
    processing_engine_run,
    schema_dataset,
    tags_run,
)
from openlineage.client.serde import Serde

import rayline.tasks.common
from rayline import lineage, storage
from rayline.errors import StorageError
from rayline.lineage import DatasetRef, openlineage_events, openlineage_facets
from rayline.ray_cluster import RayConnection
from rayline.tasks.common import openlineage_run, ray_task, record_lineage

pytestmark = pytest.mark.unit

# The facets rayline emits, by key: the client's models are abstract at the facet level.
FACETS: dict[str, type[BaseFacet]] = {
    "version": dataset_version_dataset.DatasetVersionDatasetFacet,
    "errorMessage": error_message_run.ErrorMessageRunFacet,
    "jobType": job_type_job.JobTypeJobFacet,
    "parent": parent_run.ParentRunFacet,
    "processing_engine": processing_engine_run.ProcessingEngineRunFacet,
    "tags": tags_run.TagsRunFacet,  # the client adds its version as a run tag
    "nominalTime": nominal_time_run.NominalTimeRunFacet,
    "schema": schema_dataset.SchemaDatasetFacet,
    "outputStatistics": output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet,
    openlineage_facets.ERROR_BUDGET_FACET: openlineage_facets.ErrorBudgetDatasetFacet,
}


@dataclass
class Declared:
    """Datasets declared as given, as a workload's result declares its own (``rayline.lineage.DeclaresLineage``)."""

    inputs: list[DatasetRef] = field(default_factory=list)
    outputs: list[DatasetRef] = field(default_factory=list)

    def lineage_inputs(self) -> list[DatasetRef]:
        return self.inputs

    def lineage_outputs(self) -> list[DatasetRef]:
        return self.outputs


def _structure(tp: Any, data: Any, key: str | None = None) -> Any:
    """Rebuild the client's attrs model from JSON, refusing unknown fields; the model's validators run."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if data is None:
            assert type(None) in args, f"{key}: null where {tp} is required"
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _structure(inner, data, key)
    if origin is dict:
        assert isinstance(data, dict), key
        return {k: _structure(FACETS[k] if attr.has(args[1]) else args[1], v, k) for k, v in data.items()}
    if origin is list:
        return [_structure(args[0], item, key) for item in data]
    if isinstance(tp, type) and attr.has(tp):
        attr.resolve_types(tp)
        fields = attr.fields(tp)
        assert set(data) <= {f.name for f in fields}, f"{tp.__name__}: unknown {set(data) - {f.name for f in fields}}"
        missing = [f.name for f in fields if f.init and f.default is attr.NOTHING and f.name not in data]
        assert not missing, f"{tp.__name__}: missing {missing}"
        return tp(**{f.alias: _structure(f.type, data[f.name], f.name) for f in fields if f.init and f.name in data})
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(data)
    assert isinstance(data, tp), f"{key}: {data!r} is not {tp}"
    return data


def validate(payload: dict[str, Any]) -> RunEvent:
    """A RunEvent that serialises back to exactly ``payload`` (schema URLs included)."""
    event = _structure(RunEvent, payload)
    assert Serde.to_dict(event) == payload
    return event


def _events(root: str) -> list[dict[str, Any]]:
    folder = storage.join(root, "lineage", "openlineage")
    return [storage.read_json(o.uri) for o in storage.list_objects(folder)]


def test_dataset_ids_follow_the_openlineage_naming() -> None:
    assert openlineage_events.dataset_id("s3://bucket/raw/dt=1/a.png") == ("s3://bucket", "raw/dt=1/a.png")
    assert openlineage_events.dataset_id("s3://bucket") == ("s3://bucket", "/")
    assert openlineage_events.dataset_id("data/x/") == ("file", storage.normalize("data/x"))


def test_run_ids_are_uuids() -> None:
    prefect_id = str(uuid.uuid4())
    assert openlineage_events.as_run_id(prefect_id) == prefect_id
    assert openlineage_events.as_run_id("ingest-7") == openlineage_events.as_run_id("ingest-7")
    assert uuid.UUID(openlineage_events.as_run_id("ingest-7"))
    assert openlineage_events.as_run_id(None) != openlineage_events.as_run_id(None)


def test_a_stage_run_emits_start_and_complete_with_its_datasets(local_storage: str) -> None:
    raw = DatasetRef(uri=storage.join(local_storage, "raw"), content_hash="abc123")
    manifest = DatasetRef(uri=storage.join(local_storage, "ingested", "x", "manifest.json"), content_hash="abc123")
    with openlineage_run("ingest"):
        record_lineage("ingest", Declared([raw], [manifest]), {"p": 1})

    start, complete = (validate(e) for e in _events(local_storage))
    assert start.eventType and start.eventType.value == "START" and not start.inputs and not start.outputs
    assert complete.eventType and complete.eventType.value == "COMPLETE"
    assert start.run.runId == complete.run.runId
    assert complete.job.namespace == "rayline" and complete.job.name == "ingest"
    (source,) = complete.inputs
    assert (source.namespace, source.name) == ("file", raw.uri)
    assert source.facets and source.facets["version"].datasetVersion == "abc123"  # type: ignore[attr-defined]
    (output,) = complete.outputs
    assert output.name == manifest.uri
    assert complete.run.facets and complete.run.facets["processing_engine"].name == "Ray"  # type: ignore[attr-defined]


def test_a_failing_stage_emits_fail_with_the_error_and_reraises(local_storage: str) -> None:
    with pytest.raises(ValueError, match="bad shard"), openlineage_run("preprocess"):
        raise ValueError("bad shard")
    start, fail = (validate(e) for e in _events(local_storage))
    assert fail.eventType and fail.eventType.value == "FAIL" and fail.run.runId == start.run.runId
    assert fail.run.facets
    error = fail.run.facets["errorMessage"]
    assert isinstance(error, error_message_run.ErrorMessageRunFacet)
    assert error.message == "ValueError: bad shard" and error.stackTrace and "bad shard" in error.stackTrace


def test_a_record_outside_a_task_run_is_one_complete_event(local_storage: str) -> None:
    out = DatasetRef(uri="s3://bucket/models/digits/v1")
    record_lineage("registry", Declared([], [out]), {})
    (complete,) = (validate(e) for e in _events(local_storage))
    assert complete.eventType and complete.eventType.value == "COMPLETE"
    assert [(o.namespace, o.name) for o in complete.outputs] == [("s3://bucket", "models/digits/v1")]


FAKE_CONNECTION = RayConnection(address="127.0.0.1:6379", job_id="01000000", embedded=True, num_cpus=4.0)


@pytest.fixture
def ray_connections(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """``ray_cluster.connect`` stood in for (a unit test starts no Ray): the preload of each call."""
    connected: list[tuple[str, ...]] = []

    def connect(preload: tuple[str, ...] = ()) -> RayConnection:
        connected.append(tuple(preload))
        return FAKE_CONNECTION

    monkeypatch.setattr(rayline.tasks.common.ray_cluster, "connect", connect)
    return connected


def test_ray_task_wraps_every_stage_and_keeps_its_signature(
    local_storage: str, ray_connections: list[tuple[str, ...]]
) -> None:
    def stage(count: int, label: str = "x") -> str:
        """Doc."""
        if count < 0:
            raise RuntimeError("negative")
        return label * count

    wrapped = ray_task("unit-stage")(stage)
    assert inspect.signature(wrapped.fn) == inspect.signature(stage)
    assert wrapped.fn.__doc__ == "Doc." and wrapped.name == "unit-stage"
    assert wrapped.fn(2, label="ab") == "abab"
    with pytest.raises(RuntimeError):
        wrapped.fn(-1)
    assert ray_connections == [(), ()], "each run connects to Ray before the stage runs"
    states = [(e["job"]["name"], e["eventType"]) for e in _events(local_storage)]
    assert sorted(states) == sorted(
        [("unit-stage", "START"), ("unit-stage", "COMPLETE"), ("unit-stage", "START"), ("unit-stage", "FAIL")]
    )
    for payload in _events(local_storage):
        validate(payload)


def test_a_stage_records_its_runs_start_and_ray_connection(
    local_storage: str, ray_connections: list[tuple[str, ...]]
) -> None:
    raw = DatasetRef(uri=storage.join(local_storage, "raw"), content_hash="abc123")
    recorded_at: list[datetime] = []

    def stage() -> None:
        recorded_at.append(datetime.now(UTC))
        record_lineage("unit_stage", Declared([raw], []), {"p": 1})

    ray_task("unit-stage", preload=("torch",))(stage).fn()
    (record,) = lineage.read_records("unit_stage")
    assert ray_connections == [("torch",)]
    assert (record.run.ray_job_id, record.run.ray_address) == (FAKE_CONNECTION.job_id, FAKE_CONNECTION.address)
    assert record.started_at <= recorded_at[0] <= record.ended_at, "the record starts when the run did"
    assert record.inputs == [raw] and record.parameters == {"p": 1}


def test_a_stage_that_needs_no_cluster_never_connects(
    local_storage: str, ray_connections: list[tuple[str, ...]]
) -> None:
    def stage() -> None:
        record_lineage("unit_stage", Declared([], [DatasetRef(uri="s3://bucket/models/digits/v1")]), {})

    ray_task("unit-stage", connects=False)(stage).fn()
    (record,) = lineage.read_records("unit_stage")
    assert ray_connections == []
    assert (record.run.ray_job_id, record.run.ray_address) == (None, None)


def test_a_broken_transport_never_breaks_the_stage(
    local_storage: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(uri: str, payload: Any) -> None:
        raise StorageError(f"writing {uri}: denied")

    monkeypatch.setattr(openlineage_events.storage, "write_json_atomic", refuse)
    with caplog.at_level(logging.WARNING, logger=openlineage_events.__name__), openlineage_run("ingest"):
        done = True
    assert done
    assert [r.getMessage().split(" event")[0] for r in caplog.records] == [
        "OpenLineage START",
        "OpenLineage COMPLETE",
    ]
    assert "denied" in caplog.records[0].getMessage()


def test_disabled_emits_nothing(local_storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENLINEAGE_DISABLED", "true")
    with openlineage_run("ingest"):
        pass
    assert _events(local_storage) == []


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, dict[str, Any]]] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, json.loads(body)))
        self.send_response(201)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        return


@pytest.fixture
def lineage_server() -> Iterator[str]:
    _Collector.received = []
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(autouse=True)
def _openlineage_env_restored() -> Iterator[None]:
    """The client writes ``OPENLINEAGE__…`` aliases of ``OPENLINEAGE_URL`` into the environment: undo them."""
    before = {k: v for k, v in os.environ.items() if k.startswith("OPENLINEAGE")}
    yield
    for key in [k for k in os.environ if k.startswith("OPENLINEAGE")]:
        del os.environ[key]
    os.environ.update(before)


def _stage_with_datasets(local_storage: str) -> tuple[DatasetRef, DatasetRef]:
    raw = DatasetRef(uri=storage.join(local_storage, "raw"), content_hash="abc123")
    out = DatasetRef(uri="s3://bucket/predictions/night=1")
    with openlineage_run("batch-inference"):
        record_lineage("batch_inference", Declared([raw], [out]), {})
    return raw, out


def _assert_received_the_stage(raw: DatasetRef, path: str = "/api/v1/lineage") -> None:
    assert [p for p, _ in _Collector.received] == [path] * 2
    events = [validate(body) for _, body in _Collector.received]
    assert [e.eventType.value for e in events if e.eventType] == ["START", "COMPLETE"]
    assert {e.job.name for e in events} == {"batch-inference"}
    assert [(i.namespace, i.name) for i in events[1].inputs] == [("file", raw.uri)]
    assert [(o.namespace, o.name) for o in events[1].outputs] == [("s3://bucket", "predictions/night=1")]


def test_openlineage_url_sends_events_over_http(
    local_storage: str, lineage_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENLINEAGE_URL", lineage_server)
    raw, _ = _stage_with_datasets(local_storage)
    _assert_received_the_stage(raw)
    assert _events(local_storage) == [], "HTTP replaces the file transport"


def test_an_openlineage_yml_configures_the_client(
    local_storage: str, lineage_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "openlineage.yml"
    config.write_text(f"transport:\n  type: http\n  url: {lineage_server}\n  endpoint: custom/lineage\n")
    monkeypatch.setenv("OPENLINEAGE_CONFIG", str(config))
    raw, _ = _stage_with_datasets(local_storage)
    _assert_received_the_stage(raw, "/custom/lineage")
    assert _events(local_storage) == []


def test_openlineage_double_underscore_variables_configure_the_client(
    local_storage: str, lineage_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "http")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__URL", lineage_server)
    raw, _ = _stage_with_datasets(local_storage)
    _assert_received_the_stage(raw)


def test_without_configuration_events_go_to_storage_not_the_console(
    local_storage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _stage_with_datasets(local_storage)
    assert [e["eventType"] for e in _events(local_storage)] == ["START", "COMPLETE"]
    printed = capsys.readouterr()
    assert "eventType" not in printed.out + printed.err, "the client's console fallback must not be used"


def test_the_storage_transport_can_be_named_in_a_users_configuration(
    local_storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "elsewhere"
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "rayline.lineage.openlineage_events.StorageTransport")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__ROOT", str(root))
    _stage_with_datasets(local_storage)
    assert len(list(root.glob("*-batch-inference-*.json"))) == 2
    assert _events(local_storage) == []


def test_an_unreachable_lineage_server_is_logged_and_skipped(
    local_storage: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    port = server.server_address[1]
    server.server_close()  # nothing listens there now
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "http")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__RETRY", '{"total": 0}')  # the client's default retries ~9 s
    with caplog.at_level(logging.WARNING, logger=openlineage_events.__name__):
        assert openlineage_events.emit("START", openlineage_events.RunIdentity(str(uuid.uuid4()), "ingest")) is None
    assert "OpenLineage START event of ingest" in caplog.text
