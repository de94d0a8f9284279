"""OpenLineage run events for stage runs: START, then COMPLETE, FAIL or ABORT.

Events are built with ``openlineage-python``'s models and serialised with its
``Serde``. Where they go:

- ``OPENLINEAGE_URL`` set: the client's HTTP transport (Marquez and others),
  with ``OPENLINEAGE_ENDPOINT`` and ``OPENLINEAGE_API_KEY`` as the client reads them;
- otherwise one JSON file per event under ``<storage>/lineage/openlineage/``,
  written through rayline's storage layer so that an ``s3://`` root works too
  (the client's file transport opens local files or needs its own fsspec
  credentials);
- ``OPENLINEAGE_DISABLED=true``: nowhere.

Emission never fails a stage: the lineage records under
``<storage>/lineage/<stage>/`` are the source of truth, these events a copy
for other tools, so a transport error is logged and dropped.
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
from typing import Literal

from openlineage.client.constants import __version__ as CLIENT_VERSION
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    DatasetFacet,
    JobFacet,
    RunFacet,
    dataset_version_dataset,
    error_message_run,
    job_type_job,
    parent_run,
    processing_engine_run,
)
from openlineage.client.serde import Serde
from openlineage.client.transport.http import HttpConfig, HttpTransport

from rayline import lineage, storage
from rayline.lineage import DatasetRef

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "rayline"
EVENTS_DIR = "openlineage"  # under <storage>/lineage/
# A slow or absent lineage server must not hold a stage up for long.
HTTP_TIMEOUT_S = 5.0
HTTP_RETRY = {"total": 2, "connect": 2, "read": 2, "backoff_factor": 0.2}

State = Literal["START", "COMPLETE", "FAIL", "ABORT"]


@dataclass(frozen=True)
class RunIdentity:
    """Which OpenLineage run an event belongs to, and the run (flow) that spawned it."""

    run_id: str
    job_name: str
    parent_run_id: str | None = None
    parent_job_name: str | None = None


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
    """OpenLineage (namespace, name) of a URI: ``s3://bucket`` + key, or ``file`` + absolute path."""
    if storage.is_s3(uri):
        bucket, _, key = uri[len(storage.S3) :].partition("/")
        return f"{storage.S3}{bucket}", key.rstrip("/") or "/"
    return "file", storage.normalize(uri)


@lru_cache(maxsize=1)
def producer() -> str:
    try:
        return f"urn:rayline:{version('rayline')}"
    except PackageNotFoundError:
        return "urn:rayline"


def _dataset_facets(ref: DatasetRef) -> dict[str, DatasetFacet]:
    pinned = ref.content_hash or ref.etag
    if not pinned:
        return {}
    return {"version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=pinned, producer=producer())}


def _run_facets(run: RunIdentity, error: BaseException | None) -> dict[str, RunFacet]:
    facets: dict[str, RunFacet] = {
        "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
            version=_ray_version(), name="Ray", openlineageAdapterVersion=CLIENT_VERSION, producer=producer()
        )
    }
    if run.parent_run_id and run.parent_job_name:
        facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(runId=as_run_id(run.parent_run_id)),
            job=parent_run.Job(namespace=namespace(), name=run.parent_job_name),
            producer=producer(),
        )
    if error is not None:
        facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
            message=f"{type(error).__name__}: {error}"[:2000],
            programmingLanguage="python",
            stackTrace="".join(traceback.format_exception(error))[-8000:],
            producer=producer(),
        )
    return facets


@lru_cache(maxsize=1)
def _ray_version() -> str:
    try:
        return version("ray")
    except PackageNotFoundError:
        return "unknown"


def _job_facets() -> dict[str, JobFacet]:
    return {
        "jobType": job_type_job.JobTypeJobFacet(
            processingType="BATCH", integration="RAYLINE", jobType="TASK", producer=producer()
        )
    }


def build_event(
    state: State,
    run: RunIdentity,
    inputs: Sequence[DatasetRef] = (),
    outputs: Sequence[DatasetRef] = (),
    error: BaseException | None = None,
    event_time: datetime | None = None,
) -> RunEvent:
    """A RunEvent in the client's model (its validators check time, run id and URIs)."""
    return RunEvent(
        eventType=RunState[state],
        eventTime=(event_time or datetime.now(UTC)).isoformat(),
        run=Run(runId=as_run_id(run.run_id), facets=_run_facets(run, error)),
        job=Job(namespace=namespace(), name=run.job_name, facets=_job_facets()),
        inputs=[InputDataset(*dataset_id(r.uri), facets=_dataset_facets(r)) for r in _unique(inputs)],
        outputs=[OutputDataset(*dataset_id(r.uri), facets=_dataset_facets(r)) for r in _unique(outputs)],
        producer=producer(),
    )


def _unique(refs: Sequence[DatasetRef]) -> list[DatasetRef]:
    """One dataset per URI (a task may record the same input twice); the first wins."""
    seen: dict[str, DatasetRef] = {}
    for ref in refs:
        seen.setdefault(ref.uri, ref)
    return list(seen.values())


def events_dir() -> str:
    return lineage.lineage_dir(EVENTS_DIR)


def event_uri(event: RunEvent) -> str:
    """``<time>-<job>-<state>-<run id>.json``: names sort by time, and one run's events group by id."""
    stamp = datetime.fromisoformat(event.eventTime).astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    job = "".join(c if c.isalnum() or c in "-_." else "_" for c in event.job.name)
    state = event.eventType.value if event.eventType else "OTHER"
    return storage.join(events_dir(), f"{stamp}-{job}-{state}-{event.run.runId}.json")


@lru_cache(maxsize=4)
def _http_transport(url: str, endpoint: str, api_key: str | None) -> HttpTransport:
    params: dict[str, object] = {"url": url, "endpoint": endpoint, "timeout": HTTP_TIMEOUT_S, "retry": HTTP_RETRY}
    if api_key:
        params["auth"] = {"type": "api_key", "apiKey": api_key}
    return HttpTransport(HttpConfig.from_dict(params))


def send(event: RunEvent) -> str | None:
    """Deliver one event; returns where it went (a URI or URL), None when disabled. Raises on failure."""
    if os.environ.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return None
    url = os.environ.get("OPENLINEAGE_URL")
    if url:
        endpoint = os.environ.get("OPENLINEAGE_ENDPOINT", "api/v1/lineage")
        _http_transport(url, endpoint, os.environ.get("OPENLINEAGE_API_KEY")).emit(event)
        return f"{url.rstrip('/')}/{endpoint.lstrip('/')}"
    uri = event_uri(event)
    storage.write_json_atomic(uri, json.loads(Serde.to_json(event)))
    return uri


def emit(
    state: State,
    run: RunIdentity,
    inputs: Sequence[DatasetRef] = (),
    outputs: Sequence[DatasetRef] = (),
    error: BaseException | None = None,
) -> str | None:
    """Build and deliver an event; never raises (a failure is logged as a warning and dropped)."""
    try:
        return send(build_event(state, run, inputs, outputs, error))
    except Exception as exc:
        log.warning(
            "OpenLineage %s event of %s (run %s) not sent: %s: %s",
            state,
            run.job_name,
            run.run_id,
            type(exc).__name__,
            exc,
        )
        return None
