"""Delta Lake access shared by the night tables' writer and readers: opening, nights, commit lookup.

rayline keeps its nightly outputs in Delta tables partitioned by
``model_name`` and ``dt`` (:mod:`rayline.tables.predictions_table` writes them,
:mod:`rayline.tables.prediction_reads` reads them). This module holds what both
sides need: a night's partition (:class:`Night`), delta-rs storage options
from rayline's settings, and finding the commit (run id, table version) that
last wrote a night, from the commit infos and app transactions the writer
records.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError

from rayline import storage
from rayline.config import get_settings
from rayline.errors import InputDataError, StorageError, TransientStorageError, is_transient

PARTITION_COLUMNS = ("model_name", "dt")

# Names end up in object keys and (unescaped) in Delta add-action paths, so
# they are kept to characters that need no URI encoding.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Night:
    """One partition: a model's predictions for one day."""

    model_name: str
    dt: str

    def __post_init__(self) -> None:
        if not SAFE_NAME.match(self.model_name):
            raise InputDataError(f"model name {self.model_name!r} is not usable in a partition path")
        try:
            # one spelling per day: fromisoformat also takes 20261128 and 2026-W48-1
            canonical = date.fromisoformat(self.dt).isoformat() == self.dt
        except ValueError:
            canonical = False
        if not canonical:
            raise InputDataError(f"dt {self.dt!r} is not an ISO date (YYYY-MM-DD)")

    @classmethod
    def of(cls, partition: Mapping[str, str] | Night) -> Night:
        if isinstance(partition, Night):
            return partition
        if set(partition) != set(PARTITION_COLUMNS):
            raise InputDataError(f"partition must name exactly {PARTITION_COLUMNS}, got {sorted(partition)}")
        return cls(model_name=partition["model_name"], dt=partition["dt"])

    @property
    def relative_dir(self) -> str:
        return f"model_name={self.model_name}/dt={self.dt}"

    @property
    def values(self) -> dict[str, str | None]:
        return {"model_name": self.model_name, "dt": self.dt}

    @property
    def filters(self) -> list[tuple[str, str, Any]]:
        return [("model_name", "=", self.model_name), ("dt", "=", self.dt)]

    @property
    def app_id(self) -> str:
        return f"rayline-night/{self.model_name}/{self.dt}"

    def run_app_id(self, run_id: str) -> str:
        return f"rayline-run/{run_id}/{self.model_name}/{self.dt}"


@dataclass(frozen=True)
class NightCommit:
    """The commit that last wrote a night: for readers pairing the two tables."""

    run_id: str
    version: int
    night_seq: int
    # the commit's info: rayline's keys (input URI and content hash, model version, rows, flow run) and Delta's
    info: Mapping[str, Any] = field(default_factory=dict, compare=False)


def storage_options(uri: str) -> dict[str, str] | None:
    """delta-rs options for ``uri``: endpoint and region from settings; credentials stay with the AWS SDK env."""
    if not storage.is_s3(uri):
        return None
    settings = get_settings()
    options: dict[str, str] = {}
    if settings.aws_endpoint_url:
        options["AWS_ENDPOINT_URL"] = settings.aws_endpoint_url
        # object_store refuses plain-http endpoints (moto, local gateways) unless told
        if settings.aws_endpoint_url.startswith("http://"):
            options["AWS_ALLOW_HTTP"] = "true"
    if settings.aws_region:
        options["AWS_REGION"] = settings.aws_region
    return options


def check_run_id(run_id: str) -> None:
    if not SAFE_NAME.match(run_id):
        raise InputDataError(f"run id {run_id!r} is not usable in file names and app ids")


def storage_error(exc: BaseException, action: str, uri: str) -> Exception:
    message = f"{action} {uri}: {type(exc).__name__}: {exc}"
    return TransientStorageError(message) if is_transient(exc) else StorageError(message)


def open_table(uri: str, version: int | None = None) -> DeltaTable:
    try:
        return DeltaTable(uri, version=version, storage_options=storage_options(uri))
    except TableNotFoundError as exc:
        raise InputDataError(f"no Delta table at {uri}") from exc
    except (DeltaError, OSError) as exc:
        raise storage_error(exc, "open Delta table", uri) from exc


def table_version(uri: str) -> int | None:
    """The table's current version, None before its first commit."""
    uri = storage.normalize(uri)
    if not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return None
    return open_table(uri).version()


def commit_log_bytes(uri: str, version: int) -> int:
    """The size of the ``_delta_log`` entry of ``version``: what one commit added to the log."""
    entry = storage.join(storage.normalize(uri), "_delta_log", f"{version:020d}.json")
    fs, path = storage.arrow_filesystem(entry)
    try:
        return int(fs.get_file_info(path).size or 0)
    except OSError as exc:
        raise storage_error(exc, "size of", entry) from exc


def arrow_schema(tbl: DeltaTable) -> pa.Schema:
    return pa.schema(tbl.schema().to_arrow())


def find_commit(uri: str, tbl: DeltaTable, night: Night, run_id: str | None = None) -> NightCommit | None:
    """The newest commit of ``night`` (by ``run_id`` if given) from the commit infos, newest first.

    ``DeltaTable.history`` numbers commits by position from the snapshot's
    version, but its listing can already hold newer commits, so under
    concurrent writers its numbers are off; the version is checked against the
    run's app transaction instead.
    """
    for entry in tbl.history():
        if entry.get("rayline.model_name") != night.model_name or entry.get("rayline.dt") != night.dt:
            continue
        if run_id is not None and entry.get("rayline.run_id") != run_id:
            continue
        found = str(entry["rayline.run_id"])
        # the listing of a table loaded at an older version also holds the commits after it: a run whose
        # app transaction that snapshot lacks committed later, so it is not the night as of that version
        if tbl.transaction_version(night.run_app_id(found)) is None:
            continue
        version = commit_version(uri, night.run_app_id(found), int(entry["version"]), tbl.version())
        return NightCommit(run_id=found, version=version, night_seq=int(entry["rayline.night_seq"]), info=entry)
    return None


def current_runs(tbl: DeltaTable) -> dict[Night, str]:
    """Which run last committed each night as of ``tbl``'s version: :func:`find_commit`'s rule, in one history pass.

    For a question about every night at once (vacuum's keep-set), where
    :func:`find_commit` per night would read the whole history once a night.
    """
    runs: dict[Night, str] = {}
    for entry in tbl.history():
        model_name, dt, run_id = (entry.get(f"rayline.{key}") for key in ("model_name", "dt", "run_id"))
        if model_name is None or dt is None or run_id is None:
            continue  # not a night's commit (the table's creation, a schema change)
        night = Night(str(model_name), str(dt))
        if night not in runs and tbl.transaction_version(night.run_app_id(str(run_id))) is not None:
            runs[night] = str(run_id)
    return runs


def has_txn(uri: str, version: int, app_id: str) -> bool:
    return version >= 0 and open_table(uri, version).transaction_version(app_id) is not None


def commit_version(uri: str, app_id: str, hint: int, latest: int, low: int = 0) -> int:
    """The version whose commit first carried ``app_id``: ``hint`` when right, else a binary search."""
    if low <= hint <= latest and has_txn(uri, hint, app_id) and not has_txn(uri, hint - 1, app_id):
        return hint
    latest = max(latest, open_table(uri).version())
    while low < latest:
        middle = (low + latest) // 2
        if has_txn(uri, middle, app_id):
            latest = middle
        else:
            low = middle + 1
    return low


def night_commit(uri: str, model_name: str, dt: str, version: int | None = None) -> NightCommit | None:
    """Which run last committed a night (as of ``version``), at which table version: for pairing the tables."""
    uri = storage.normalize(uri)
    return find_commit(uri, open_table(uri, version), Night(model_name, dt))


def run_committed(table: str, night: Night, run_id: str) -> bool:
    """Whether ``run_id`` committed the night to ``table`` (its app transaction: no history scan)."""
    if table_version(table) is None:
        return False
    return open_table(table).transaction_version(night.run_app_id(run_id)) is not None


def attempt_run_id(predictions: str, errors_table: str, night: Night, run_id: str) -> tuple[str, NightCommit | None]:
    """The id this attempt commits under, and the predictions commit when the run's commit already landed.

    An attempt that committed its errors but not its predictions left the
    first attempt's error rows in the errors table: pairing them with a new
    attempt's predictions could name an input in both tables, so the next
    attempt predicts and commits both tables under a derived id
    (``<run_id>.2``, …), which replaces that errors commit.
    """
    for attempt in range(1, 10):
        candidate = run_id if attempt == 1 else f"{run_id}.{attempt}"
        if run_committed(predictions, night, candidate):
            return candidate, find_commit(predictions, open_table(predictions), night, candidate)
        if not run_committed(errors_table, night, candidate):
            return candidate, None
    raise StorageError(f"run {run_id} committed {night.relative_dir}'s errors 9 times without its predictions")
