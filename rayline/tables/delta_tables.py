"""Delta Lake access shared by the night tables' writer and readers: a night's partition (:class:`Night`),
opening tables, and finding the commit (run id, table version) that last wrote a night.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from rayline import storage
from rayline.errors import DeltaWritesUnsupported, InputDataError, StorageError, TransientStorageError, is_transient
from rayline.tables import delta_log

PARTITION_COLUMNS = ("model_name", "dt")

# Names end up in object keys and (unescaped) in Delta add-action paths: characters that need no URI encoding.
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


KEY_PREFIX = "rayline."  # of rayline's keys in a commit's info, beside Delta's own
# Commit-info values that are JSON text: Delta keeps a commit's info as flat keys of plain values.
_JSON_TEXT = ("error_types", "plans", "plan_use", "shadow_summary")


class NightCommit(BaseModel):
    """One table's commit of a night: the only place the keys of its info are spelled (``rayline.<field>``).

    ``commit_night`` sets the night's own fields; the rest is the run's record (None without one).
    ``version`` and ``already_committed`` (found, not made by this call) say where it is, not what it holds."""

    model_config = ConfigDict(frozen=True, alias_generator=lambda name: KEY_PREFIX + name, populate_by_name=True)

    run_id: str
    model_name: str
    dt: str
    night_seq: int = Field(0, description="The night's commit count with this commit: 1 for its first.")
    files: int = 0
    rows: int = 0
    input_uri: str | None = None
    input_content_hash: str | None = None
    input_digest: str | None = None
    inputs: int | None = None
    model_version: int | None = None
    weights_uri: str | None = None
    code_version: str | None = None
    flow_run_id: str | None = None
    error_types: dict[str, int] | None = None
    plans: list[str] | None = None
    plan_use: dict[str, dict[str, Any]] | None = None
    shadow_summary: dict[str, Any] | None = None
    core_seconds: float | None = None
    version: int = Field(-1, exclude=True)
    already_committed: bool = Field(False, exclude=True)

    @field_validator(*_JSON_TEXT, mode="before")
    @classmethod
    def _parsed(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    @field_serializer(*_JSON_TEXT)
    def _as_text(self, value: Any) -> str | None:
        return None if value is None else json.dumps(value, sort_keys=True)

    @property
    def replaced(self) -> bool:
        """Whether this commit replaced an earlier run's night."""
        return self.night_seq > 1

    def to_metadata(self) -> dict[str, Any]:
        """The commit's info as Delta stores it."""
        return self.model_dump(by_alias=True, exclude_none=True)

    @classmethod
    def from_metadata(cls, info: Mapping[str, Any], version: int = -1) -> NightCommit | None:
        """The commit an info describes (Delta's own keys ignored), at ``version``; None when it is no
        night's commit (the table's creation, a schema change)."""
        ours = {key: value for key, value in info.items() if key.startswith(KEY_PREFIX)}
        if any(KEY_PREFIX + name not in ours for name, field in cls.model_fields.items() if field.is_required()):
            return None
        return cls.model_validate({**ours, "version": version})

    def is_of(self, night: Night, run_id: str | None = None) -> bool:
        return (self.model_name, self.dt) == (night.model_name, night.dt) and run_id in (None, self.run_id)


def storage_options(uri: str) -> dict[str, str] | None:
    """delta-rs options for ``uri`` (:func:`rayline.storage.delta_options`)."""
    return storage.delta_options(uri)


def check_run_id(run_id: str) -> None:
    if not SAFE_NAME.match(run_id):
        raise InputDataError(f"run id {run_id!r} is not usable in file names and app ids")


def storage_error(exc: BaseException, action: str, uri: str) -> Exception:
    message = f"{action} {uri}: {type(exc).__name__}: {exc}"
    return TransientStorageError(message) if is_transient(exc) else StorageError(message)


@contextmanager
def delta_errors(action: str, uri: str, *also: type[Exception]) -> Iterator[None]:
    """Run the body; what delta-rs or the filesystem (or ``also``) raised comes out as :func:`storage_error`'s."""
    caught: tuple[type[Exception], ...] = (DeltaError, OSError, *also)
    try:
        yield
    except caught as exc:
        raise storage_error(exc, action, uri) from exc


def is_table(uri: str) -> bool:
    return bool(DeltaTable.is_deltatable(uri, storage_options(uri)))


def open_table(uri: str, version: int | None = None) -> DeltaTable:
    try:
        return DeltaTable(uri, version=version, storage_options=storage_options(uri))
    except TableNotFoundError as exc:
        raise InputDataError(f"no Delta table at {uri}") from exc
    except (DeltaError, OSError) as exc:
        raise storage_error(exc, "open Delta table", uri) from exc


# Delta deletes commit files older than 30 days at checkpoints by default; rayline finds which run
# committed a night (and the errors commit of the same run, or which import wrote a label) in the commit
# history, so a table not written for a month would lose that. Commit files are small: keep them all.
TABLE_CONFIGURATION: dict[str, str | None] = {"delta.enableExpiredLogCleanup": "false"}


def open_or_create(uri: str, schema: pa.Schema, partition_by: list[str]) -> DeltaTable:
    """The table at ``uri``, created first when there is none; of writers creating it at once, one creates it
    and the others open what it created."""
    refusal = storage.delta_write_refusal(uri)
    if refusal is not None:
        raise DeltaWritesUnsupported(f"not writing the Delta table {uri}: {refusal}")
    options = storage_options(uri)
    if not DeltaTable.is_deltatable(uri, options):
        try:
            DeltaTable.create(
                uri,
                schema,
                mode="ignore",
                partition_by=partition_by,
                configuration=TABLE_CONFIGURATION,
                storage_options=options,
                # no retry: delta-rs retries a lost version 0 as another CREATE TABLE at version 1, with a new
                # table id that outside readers (a Spark stream) refuse
                commit_properties=CommitProperties(max_commit_retries=0),
            )
        except DeltaError:
            if not DeltaTable.is_deltatable(uri, options):
                raise
    return open_table(uri)


def table_version(uri: str) -> int | None:
    """The table's current version, None before its first commit."""
    uri = storage.normalize(uri)
    return open_table(uri).version() if is_table(uri) else None


def commit_log_bytes(uri: str, version: int) -> int:
    """The size of the ``_delta_log`` entry of ``version``: what one commit added to the log."""
    entry = storage.join(storage.normalize(uri), "_delta_log", f"{version:020d}.json")
    fs, path = storage.arrow_filesystem(entry)
    with delta_errors("size of", entry):
        return int(fs.get_file_info(path).size or 0)


def arrow_schema(tbl: DeltaTable) -> pa.Schema:
    return pa.schema(tbl.schema().to_arrow())


# A night's newest commits are usually among the table's newest (the run that just committed, the monitor's
# latest nights): looked for there first, in one read of this many commit infos.
RECENT_COMMITS = 32
# Nights whose current run the app transactions do not tell (commits by releases that gave every run
# transaction version 1): past this many, one pass over the history finds them all.
MAX_NIGHTS_LOOKED_UP_ONE_BY_ONE = 4


def find_commit(uri: str, tbl: DeltaTable, night: Night, run_id: str | None = None) -> NightCommit | None:
    """The newest commit of ``night`` (by ``run_id`` if given) as of ``tbl``'s version.

    Bounded by the night's app transactions, not by the table's history: a night (or run) that ``tbl`` has
    no transaction for has no commit; otherwise the newest :data:`RECENT_COMMITS` commit infos, else the
    version that set the transaction (:func:`rayline.tables.delta_log.version_setting`) and that commit file.
    ``DeltaTable.history`` numbers commits by position, which concurrent writers put off: the version is
    checked against the run's app transaction instead.
    """
    seq = tbl.transaction_version(night.app_id)
    if seq is None or (run_id is not None and not _run_committed(tbl, night, run_id)):
        return None
    for entry in tbl.history(RECENT_COMMITS):
        found = NightCommit.from_metadata(entry)
        if found is not None and found.is_of(night, run_id) and _run_committed(tbl, night, found.run_id):
            version = _version_of_commit(uri, night, found.run_id, int(entry["version"]), tbl.version())
            return found.model_copy(update={"version": version})
    app_id, at_least = (night.app_id, seq) if run_id is None else (night.run_app_id(run_id), 1)
    setting = delta_log.version_setting(uri, app_id, at_least, tbl.version())
    # None: a log laid out otherwise; then the table is loaded at each version of a binary search
    version = commit_version(uri, app_id, -1, tbl.version(), at_least=at_least) if setting is None else setting
    found = NightCommit.from_metadata(delta_log.commit_info(uri, version) or {}, version)
    if found is None or not found.is_of(night, run_id):
        raise StorageError(f"the commit info of version {version} of {uri} is gone or is not {night.relative_dir}'s")
    return found


def _run_committed(tbl: DeltaTable, night: Night, run_id: str) -> bool:
    return tbl.transaction_version(night.run_app_id(run_id)) is not None


def _version_of_commit(uri: str, night: Night, run_id: str, hint: int, latest: int) -> int:
    """The version of a history entry: its positional number (``hint``) when that commit file is the run's
    (a run commits a night once), else found by the run's app transaction."""
    at_hint = NightCommit.from_metadata(delta_log.commit_info(uri, hint) or {}) if 0 <= hint <= latest else None
    if at_hint is not None and at_hint.is_of(night, run_id):
        return hint
    return commit_version(uri, night.run_app_id(run_id), hint, latest)


_NIGHT_APP = re.compile(r"^rayline-night/(?P<model>[^/]+)/(?P<dt>[^/]+)$")
_RUN_APP = re.compile(r"^rayline-run/(?P<run>[^/]+)/(?P<model>[^/]+)/(?P<dt>[^/]+)$")


def current_runs(uri: str, tbl: DeltaTable) -> dict[Night, str]:
    """Which run last committed each night as of ``tbl``'s version: :func:`find_commit`'s rule for every night,
    for vacuum's keep-set. From the app transactions (:func:`rayline.tables.delta_log.app_transactions`): each
    commit sets its run's transaction to the night's commit count, so the night's current run is the one whose
    transaction equals the night's. Nights committed by releases that gave every run version 1 are found in
    the history."""
    transactions = delta_log.app_transactions(uri, tbl.version())
    if transactions is None:
        return _runs_from_history(tbl, None)
    seqs: dict[tuple[str, str], int] = {}
    runs_at: dict[tuple[str, str, int], list[str]] = {}  # by model, day and transaction version
    for app_id, version in transactions.items():
        if night_app := _NIGHT_APP.match(app_id):
            seqs[night_app["model"], night_app["dt"]] = version
        elif run_app := _RUN_APP.match(app_id):
            runs_at.setdefault((run_app["model"], run_app["dt"], version), []).append(run_app["run"])
    runs: dict[Night, str] = {}
    unknown: set[Night] = set()
    for (model_name, dt), seq in seqs.items():
        candidates = runs_at.get((model_name, dt, seq), [])
        if len(candidates) == 1:
            runs[Night(model_name, dt)] = candidates[0]
        else:
            unknown.add(Night(model_name, dt))
    if len(unknown) > MAX_NIGHTS_LOOKED_UP_ONE_BY_ONE:
        return {**runs, **_runs_from_history(tbl, unknown)}
    for night in unknown:
        commit = find_commit(uri, tbl, night)
        if commit is not None:
            runs[night] = commit.run_id
    return runs


def _runs_from_history(tbl: DeltaTable, nights: set[Night] | None) -> dict[Night, str]:
    """The current run of ``nights`` (None: every night) from the commit infos, newest first, until all are found."""
    runs: dict[Night, str] = {}
    for entry in tbl.history():
        commit = NightCommit.from_metadata(entry)
        if commit is None:
            continue  # not a night's commit (the table's creation, a schema change)
        night = Night(commit.model_name, commit.dt)
        if nights is not None and night not in nights:
            continue
        if night not in runs and _run_committed(tbl, night, commit.run_id):
            runs[night] = commit.run_id
            if nights is not None and len(runs) == len(nights):
                break
    return runs


def has_txn(uri: str, version: int, app_id: str, at_least: int = 1) -> bool:
    """Whether ``app_id``'s transaction is at ``at_least`` or above as of ``version``."""
    if version < 0:
        return False
    found = open_table(uri, version).transaction_version(app_id)
    return found is not None and found >= at_least


def commit_version(uri: str, app_id: str, hint: int, latest: int, low: int = 0, at_least: int = 1) -> int:
    """The version whose commit first set ``app_id``'s transaction to ``at_least`` or above: ``hint`` when
    right, else a binary search (a transaction's version only grows)."""
    if low <= hint <= latest and has_txn(uri, hint, app_id, at_least) and not has_txn(uri, hint - 1, app_id, at_least):
        return hint
    latest = max(latest, open_table(uri).version())
    while low < latest:
        middle = (low + latest) // 2
        if has_txn(uri, middle, app_id, at_least):
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
    return table_version(table) is not None and _run_committed(open_table(table), night, run_id)


def attempt_run_id(predictions: str, errors_table: str, night: Night, run_id: str) -> tuple[str, NightCommit | None]:
    """The id this attempt commits under, and the predictions commit when the run's commit already landed.
    An attempt that committed its errors but not its predictions left its error rows in the errors table:
    pairing them with a new attempt's predictions could name an input in both tables, so the next attempt
    commits both tables under a derived id (``<run_id>.2``, …), which replaces that errors commit."""
    for attempt in range(1, 10):
        candidate = run_id if attempt == 1 else f"{run_id}.{attempt}"
        if run_committed(predictions, night, candidate):
            landed = find_commit(predictions, open_table(predictions), night, candidate)
            return candidate, landed.model_copy(update={"already_committed": True}) if landed else None
        if not run_committed(errors_table, night, candidate):
            return candidate, None
    raise StorageError(f"run {run_id} committed {night.relative_dir}'s errors 9 times without its predictions")
