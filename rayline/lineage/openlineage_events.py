"""OpenLineage run events for stage runs and flow runs: START, then COMPLETE, FAIL or ABORT.

A stage's run (a Prefect task) names its flow run as its parent; a flow run names its calling flow run (a subflow)
or the deployment's schedule or trigger that started it (:func:`trigger_run`, whose run has events of its own).
Datasets carry what their refs read back (:mod:`rayline.lineage.openlineage_facets`).

Events are built with ``openlineage-python``'s models and sent through its ``OpenLineageClient``, so the client's own
configuration decides where they go, as in every other OpenLineage integration: an ``openlineage.yml``
(``OPENLINEAGE_CONFIG``, the working directory, ``~/.openlineage``), ``OPENLINEAGE__TRANSPORT__…`` variables,
``OPENLINEAGE_URL`` (+ ``OPENLINEAGE_ENDPOINT``, ``OPENLINEAGE_API_KEY``), ``OPENLINEAGE_DISABLED``.

With none of these the client would print every event to the console; rayline's default instead is one JSON
file per event under ``<storage>/lineage/openlineage/``, written by :class:`StorageTransport` through rayline's
storage layer so that a cloud root works too (the client's file transport opens local files only). A user may
name that transport in their own configuration (``type: rayline.lineage.openlineage_events.StorageTransport``).

Emission never fails a stage: the lineage records are the source of truth, these events a copy for other
tools, so a transport error is logged and dropped.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal

from openlineage.client.client import OpenLineageClient
from openlineage.client.constants import __version__ as CLIENT_VERSION
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    JobFacet,
    RunFacet,
    error_message_run,
    job_type_job,
    nominal_time_run,
    parent_run,
    processing_engine_run,
)
from openlineage.client.serde import Serde
from openlineage.client.transport.noop import NoopConfig, NoopTransport
from openlineage.client.transport.transport import Config, Transport

from rayline import lineage, storage
from rayline.lineage import DatasetRef
from rayline.lineage.openlineage_facets import dataset_facets, output_facets
from rayline.storage import layout

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "rayline"

State = Literal["START", "COMPLETE", "FAIL", "ABORT"]


# The kinds of job rayline's events name (the ``jobType`` facet): a stage (a Prefect task running Ray work),
# a Prefect flow run, and what started a deployment's flow run: one of its schedules or a trigger (an automation).
JobType = Literal["TASK", "FLOW", "SCHEDULE", "TRIGGER"]


@dataclass(frozen=True)
class RunIdentity:
    """Which OpenLineage run an event belongs to, and the run that spawned it: a task's flow run, a subflow's
    calling flow run, a deployment's flow run's schedule or trigger."""

    run_id: str
    job_name: str
    parent_run_id: str | None = None
    parent_job_name: str | None = None
    job_type: JobType = "TASK"
    nominal_time: datetime | None = None  # a scheduled run's slot


def trigger_run(
    kind: str | None,
    trigger_id: str | None,
    trigger_name: str | None,
    deployment: str | None,
    flow_run_id: str,
    scheduled_slot: str | None = None,
    nominal_time: datetime | None = None,
) -> RunIdentity | None:
    """The run that started a deployment's flow run, from Prefect's ``created_by``: a schedule's tick (``kind``
    ``SCHEDULE``; one run per slot, its id derived from the slot Prefect keys it by) or an automation's firing
    (``AUTOMATION``). None for anything else: a run started by hand, a flow called directly.

    Its job is named after the deployment (``<flow>/<deployment>``) and the schedule or automation, as the
    Prefect UI names them."""
    if not deployment or not trigger_id:
        return None
    label = trigger_name or trigger_id
    if kind == "SCHEDULE":
        return RunIdentity(
            run_id=as_run_id(scheduled_slot or f"{trigger_id}:{flow_run_id}"),
            job_name=f"{deployment}/schedule/{label}",
            job_type="SCHEDULE",
            nominal_time=nominal_time,
        )
    if kind == "AUTOMATION":
        return RunIdentity(
            run_id=as_run_id(f"{trigger_id}:{flow_run_id}"),
            job_name=f"{deployment}/trigger/{label}",
            job_type="TRIGGER",
        )
    return None


def namespace() -> str:
    """The job namespace: ``OPENLINEAGE_NAMESPACE`` as other integrations read it, else ``rayline``."""
    return os.environ.get("OPENLINEAGE_NAMESPACE") or DEFAULT_NAMESPACE


def as_run_id(value: str | None) -> str:
    """A UUID run id: ``value`` when it is one (Prefect's ids are), a stable UUID derived from it, or a new one."""
    if not value:
        return str(uuid.uuid4())
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"rayline:{value}"))


def dataset_id(uri: str) -> tuple[str, str]:
    """OpenLineage (namespace, name) of a URI, by its naming spec: ``s3://bucket`` or ``gs://bucket`` + key,
    ``wasbs://container@account.blob.core.windows.net`` + key, or ``file`` + absolute path."""
    if storage.is_remote(uri):
        namespace, _, key = storage.hadoop_uri(uri).partition("://")[2].partition("/")
        return f"{storage.hadoop_uri(uri).partition('://')[0]}://{namespace}", key.rstrip("/") or "/"
    return "file", storage.normalize(uri)


def dataset_uri(uri: str) -> str:
    """The dataset's URI by the same naming: ``<namespace>/<name>`` (``file://`` + the absolute path locally), the
    key other tools (Prefect's assets) know it by."""
    space, name = dataset_id(uri)
    if space == "file":
        return f"file://{name}"
    return space if name == "/" else f"{space}/{name}"


@lru_cache(maxsize=2)
def _installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def producer() -> str:
    installed = _installed("rayline")
    return f"urn:rayline:{installed}" if installed else "urn:rayline"


def _engine(run: RunIdentity) -> processing_engine_run.ProcessingEngineRunFacet:
    """A stage runs on Ray; a flow run, and what started it, on Prefect."""
    name, package = ("Ray", "ray") if run.job_type == "TASK" else ("Prefect", "prefect")
    return processing_engine_run.ProcessingEngineRunFacet(
        version=_installed(package) or "unknown",
        name=name,
        openlineageAdapterVersion=CLIENT_VERSION,
        producer=producer(),
    )


def _run_facets(run: RunIdentity, error: BaseException | str | None) -> dict[str, RunFacet]:
    facets: dict[str, RunFacet] = {"processing_engine": _engine(run)}
    if run.parent_run_id and run.parent_job_name:
        facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(runId=as_run_id(run.parent_run_id)),
            job=parent_run.Job(namespace=namespace(), name=run.parent_job_name),
            producer=producer(),
        )
    if run.nominal_time is not None:
        facets["nominalTime"] = nominal_time_run.NominalTimeRunFacet(
            nominalStartTime=run.nominal_time.astimezone(UTC).isoformat(), producer=producer()
        )
    if isinstance(error, str):  # what the orchestrator said of a run that failed elsewhere (a flow's task)
        facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
            message=error[:2000], programmingLanguage="python", producer=producer()
        )
    elif error is not None:
        facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
            message=f"{type(error).__name__}: {error}"[:2000],
            programmingLanguage="python",
            stackTrace="".join(traceback.format_exception(error))[-8000:],
            producer=producer(),
        )
    return facets


def _job_facets(run: RunIdentity) -> dict[str, JobFacet]:
    return {
        "jobType": job_type_job.JobTypeJobFacet(
            processingType="BATCH", integration="RAYLINE", jobType=run.job_type, producer=producer()
        )
    }


def build_event(
    state: State,
    run: RunIdentity,
    inputs: Sequence[DatasetRef] = (),
    outputs: Sequence[DatasetRef] = (),
    error: BaseException | str | None = None,
    event_time: datetime | None = None,
) -> RunEvent:
    """A RunEvent in the client's model (its validators check time, run id and URIs)."""
    return RunEvent(
        eventType=RunState[state],
        eventTime=(event_time or datetime.now(UTC)).isoformat(),
        run=Run(runId=as_run_id(run.run_id), facets=_run_facets(run, error)),
        job=Job(namespace=namespace(), name=run.job_name, facets=_job_facets(run)),
        inputs=[InputDataset(*dataset_id(r.uri), facets=dataset_facets(r, producer())) for r in _unique(inputs)],
        outputs=[
            OutputDataset(
                *dataset_id(r.uri), facets=dataset_facets(r, producer()), outputFacets=output_facets(r, producer())
            )
            for r in _unique(outputs)
        ],
        producer=producer(),
    )


def _unique(refs: Sequence[DatasetRef]) -> list[DatasetRef]:
    """One dataset per URI (a task may record the same input twice); the first wins."""
    seen: dict[str, DatasetRef] = {}
    for ref in refs:
        seen.setdefault(ref.uri, ref)
    return list(seen.values())


def events_dir() -> str:
    return lineage.lineage_dir(layout.OPENLINEAGE_DIR)


class StorageTransportConfig(Config):
    """Where :class:`StorageTransport` writes: a folder URI, or (unset) ``<storage>/lineage/openlineage/``."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> StorageTransportConfig:
        root = params.get("root")
        return cls(root=str(root) if root else None)


class StorageTransport(Transport):
    """An OpenLineage transport writing one JSON file per event through rayline's storage (local or S3)."""

    kind = "rayline_storage"
    config_class = StorageTransportConfig

    def __init__(self, config: StorageTransportConfig) -> None:
        self.config = config

    def uri(self, event: RunEvent) -> str:
        """``<time>-<job>-<state>-<run id>.json``: names sort by time, and one run's events group by id."""
        stamp = datetime.fromisoformat(event.eventTime).astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        job = "".join(c if c.isalnum() or c in "-_." else "_" for c in event.job.name)
        state = event.eventType.value if event.eventType else "OTHER"
        return storage.join(self.config.root or events_dir(), f"{stamp}-{job}-{state}-{event.run.runId}.json")

    def emit(self, event: Any) -> str:
        if not isinstance(event, RunEvent):
            raise TypeError(f"{self.kind} writes run events, not {type(event).__name__}")
        uri = self.uri(event)
        storage.write_json_atomic(uri, json.loads(Serde.to_json(event)))
        return uri


def _configured_by_user() -> bool:
    """True when the client's own resolution finds a transport (anything but its console fallback)."""
    if os.environ.get("OPENLINEAGE_URL") or os.environ.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return True
    # an explicit transport skips the client's resolution; its config property still reads file and env
    probe = OpenLineageClient(transport=NoopTransport(NoopConfig()))
    transport = probe.config.transport or {}
    return bool(transport.get("type"))


def _config_fingerprint() -> tuple[object, ...]:
    """What the client's configuration is read from: a new client only when one of these changed."""
    candidates = [os.environ.get("OPENLINEAGE_CONFIG"), os.path.join(os.getcwd(), "openlineage.yml")]
    candidates.append(os.path.join(os.path.expanduser("~/.openlineage"), "openlineage.yml"))
    files = tuple((path, os.stat(path).st_mtime_ns) for path in candidates if path and os.path.isfile(path))
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("OPENLINEAGE")))
    return files, env


@lru_cache(maxsize=4)
def _client_for(fingerprint: tuple[object, ...]) -> OpenLineageClient:
    if _configured_by_user():
        return OpenLineageClient()
    return OpenLineageClient(transport=StorageTransport(StorageTransportConfig()))


def client() -> OpenLineageClient:
    """The OpenLineage client for the current configuration (rebuilt when that changes)."""
    return _client_for(_config_fingerprint())


def send(event: RunEvent) -> str | None:
    """Deliver one event; returns where it went (a URI or the transport kind), None when disabled; raises on failure."""
    sender = client()
    transport = sender.transport
    if transport.kind == NoopTransport.kind:
        return None
    sender.emit(event)
    if isinstance(transport, StorageTransport):
        return transport.uri(event)
    return str(transport.kind)


def emit(
    state: State,
    run: RunIdentity,
    inputs: Sequence[DatasetRef] = (),
    outputs: Sequence[DatasetRef] = (),
    error: BaseException | str | None = None,
) -> str | None:
    """Build and deliver an event (``error``: the exception, or only its message); never raises (a failure is
    logged as a warning and dropped)."""
    try:
        return send(build_event(state, run, inputs, outputs, error))
    except Exception as exc:  # emission never fails a stage: any transport or encoding error is logged
        log.warning(
            "OpenLineage %s event of %s (run %s) not sent: %s: %s",
            state,
            run.job_name,
            run.run_id,
            type(exc).__name__,
            exc,
        )
        return None
