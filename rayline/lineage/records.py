"""Lineage records: which inputs, parameters and code produced which outputs.

One JSON record per stage run under ``<storage>/lineage/<stage>/``, written atomically. Records stand on their own
(Prefect's open-source server has no lineage view); later stages reference earlier outputs by URI and content hash, so
the graph can be walked from any output back to raw objects.
"""

from __future__ import annotations

import functools
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import InputDataError
from rayline.storage.layout import LINEAGE_DIR as LINEAGE_DIR

# How a dataset is stored, so that its schema and size can be read back (rayline.lineage.written): a Delta table at
# a version, a rayline manifest committing Parquet files (or photo copies), one Parquet, JSON or CSV file, a registry
# version, a folder of files, or a registry version a run moved an alias to (it wrote nothing into the version).
StoredAs = Literal["delta", "manifest", "parquet", "json", "csv", "model", "folder", "alias"]


class Column(BaseModel):
    """One field of a dataset's schema as it was written: its name, its type as the format names it, nested fields."""

    name: str
    type: str
    description: str | None = None
    fields: list[Column] = Field(default_factory=list)


class Written(BaseModel):
    """A dataset as read back from storage: its columns, and what the run wrote to it where known."""

    columns: list[Column] = Field(default_factory=list)
    rows: int | None = None
    bytes: int | None = None
    files: int | None = None


class ErrorBudget(BaseModel):
    """A night's rows against the share of failed inputs it allows: the predictions tables' data quality."""

    rows: int = Field(description="The night's inputs: rows of predictions plus rows of errors.")
    error_rows: int
    budget: float = Field(description="The share of inputs that may fail (the night's max_error_fraction).")

    @property
    def error_fraction(self) -> float:
        return self.error_rows / self.rows if self.rows else 0.0

    @property
    def within(self) -> bool:
        return self.error_fraction <= self.budget


class DatasetRef(BaseModel):
    """A dataset a stage read or wrote, pinned to a version."""

    uri: str
    content_hash: str | None = None
    etag: str | None = None
    facets: dict[str, Any] = Field(default_factory=dict)
    stored_as: StoredAs | None = Field(None, description="How it is stored: what its schema and size are read from.")
    table_version: int | None = Field(None, description="A Delta table's version that holds the run's commit.")
    written: Written | None = Field(None, description="Its schema and size, read back when the run recorded it.")
    quality: ErrorBudget | None = None


class DeclaresLineage(Protocol):
    """A stage's result that names the datasets it read and wrote, pinned to versions: the task recording its
    lineage (and OpenLineage events) takes them from here, as the workload that produced them knows what they were."""

    def lineage_inputs(self) -> list[DatasetRef]:
        """The datasets the stage read."""

    def lineage_outputs(self) -> list[DatasetRef]:
        """The datasets the stage wrote (or found committed and reused)."""


class RunContext(BaseModel):
    """Where a stage ran: orchestrator and cluster identifiers."""

    flow_run_id: str | None = None
    flow_name: str | None = None
    task_run_id: str | None = None
    task_name: str | None = None
    ray_job_id: str | None = None
    ray_address: str | None = None


class LineageRecord(BaseModel):
    """One stage run: inputs, outputs, parameters, code version and run ids."""

    record_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    stage: str
    started_at: datetime
    ended_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    inputs: list[DatasetRef]
    outputs: list[DatasetRef]
    parameters: dict[str, Any] = Field(default_factory=dict)
    code_version: str
    run: RunContext = Field(default_factory=RunContext)
    status: str = "COMPLETED"
    cached: bool = False


@functools.cache
def code_version() -> str:
    """The git commit of rayline's source (``+dirty`` when modified), else the package version."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=5).stdout

    try:
        sha = git("rev-parse", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
        return f"git:{sha}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"pkg:rayline=={version('rayline')}"
        except PackageNotFoundError:
            return "unknown"


def lineage_dir(stage: str | None = None) -> str:
    base = storage.join(storage.storage_root(), LINEAGE_DIR)
    return storage.join(base, stage) if stage else base


def write_record(record: LineageRecord, *, maybe_written: bool = False) -> str:
    """Store ``record`` and return its URI (names sort by time). ``maybe_written``: an earlier attempt of the same
    run (same ``record_id``) may have stored it already; that record then stands."""
    if maybe_written:
        for existing in storage.list_objects(lineage_dir(record.stage)):
            if existing.key.endswith(f"-{record.record_id}.json"):
                return existing.uri
    stamp = record.ended_at.strftime("%Y%m%dT%H%M%S%fZ")
    uri = storage.join(lineage_dir(record.stage), f"{stamp}-{record.record_id}.json")
    storage.write_json_atomic(uri, record.model_dump(mode="json"))
    return uri


def read_records(stage: str) -> list[LineageRecord]:
    """All records of one stage, oldest first."""
    objects = storage.list_objects(lineage_dir(stage))
    return [LineageRecord.model_validate(storage.read_json(o.uri)) for o in objects if o.key.endswith(".json")]


def is_storage_uri(uri: str) -> bool:
    """Whether a ref's URI is storage (a cloud store, a local path, ``file://``), not one that only names an origin."""
    return storage.is_remote(uri) or "://" not in uri or uri.startswith("file://")


def normalize_uri(uri: str) -> str:
    """Storage URIs normalized; any other (an outside model's ``https://`` weights) kept as it is."""
    try:
        return storage.normalize(uri)
    except InputDataError:  # not storage: a URI that only names where something came from
        return uri.rstrip("/")
