"""Nightly predictions as Delta Lake tables: the driver's one commit per table per night.

``predictions`` and ``prediction_errors``, partitioned by ``model_name`` and ``dt``: actors write
Parquet files inside the night's partition folder, invisible until :func:`commit_night` commits them
as one ``overwrite`` of that partition, errors first; two app transactions make a retried commit a
no-op and serialise commits of one night. Who writes what, concurrency, what a reader sees between
the two commits, and vacuum: docs/nights.md.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction
from deltalake import Field as DeltaField
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction

from rayline import storage
from rayline.errors import ConfigError, InputDataError, NightCommittedElsewhere, TransientStorageError
from rayline.storage import conditional_probe
from rayline.tables.delta_tables import (
    PARTITION_COLUMNS,
    SAFE_NAME,
    Night,
    NightCommit,
    arrow_schema,
    check_run_id,
    commit_version,
    delta_errors,
    find_commit,
    is_table,
    open_or_create,
    open_table,
    storage_error,
)

_SAFE_PATH = re.compile(r"^[A-Za-z0-9._=/-]+$")

# The data columns of the two tables (the partition columns model_name and dt live in the Delta log).
PREDICTIONS_SCHEMA = pa.schema(
    [
        ("uri", pa.string()),
        ("etag", pa.string()),
        ("predicted_index", pa.int64()),
        ("predicted_class", pa.string()),
        ("confidence", pa.float32()),
        # plain list columns (not tensors), so any Parquet reader understands them
        ("top_k_index", pa.list_(pa.int64())),
        ("top_k_prob", pa.list_(pa.float64())),
        ("top_k_class", pa.list_(pa.string())),
        ("inference_ms", pa.float32()),
        ("model_version", pa.int64()),
        ("code_version", pa.string()),
        ("flow_run_id", pa.string()),
        # how the row was computed: its execution plan, backend/precision[/layout]
        # (rayline.ray_workloads.execution.plan)
        ("plan", pa.string()),
    ]
)
ERRORS_SCHEMA = pa.schema([(name, pa.string()) for name in ("uri", "stage", "error_type", "error_message")])


def data_file_uri(table: str, night: Night, run_id: str, part: str | int) -> str:
    """Where an actor writes one Parquet part of a night so that the driver can commit it."""
    check_run_id(run_id)
    name = f"part-{run_id}-{part}.parquet"
    if not SAFE_NAME.match(name):
        raise InputDataError(f"part {part!r} is not usable in a file name")
    return storage.join(storage.normalize(table), night.relative_dir, name)


def write_data_file(table: str, night: Night, run_id: str, part: str | int, data: pa.Table) -> str:
    """Write one uncommitted part (partition columns dropped: Delta stores them in the log); its URI."""
    uri = data_file_uri(table, night, run_id, part)
    body = data.drop_columns([c for c in PARTITION_COLUMNS if c in data.column_names])
    fs, path = storage.arrow_filesystem(uri)
    with delta_errors("write", uri):
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        pq.write_table(body, path, filesystem=fs)
    return uri


def table_schema(data_schema: pa.Schema) -> pa.Schema:
    """The table's schema: the data columns, then the partition columns as strings."""
    for name in PARTITION_COLUMNS:
        index = data_schema.get_field_index(name)
        if index >= 0:
            if data_schema.field(index).type != pa.string():
                raise ConfigError(f"partition column {name!r} must be a string, got {data_schema.field(index).type}")
            data_schema = data_schema.remove(index)
    return pa.schema([*data_schema, *(pa.field(name, pa.string()) for name in PARTITION_COLUMNS)])


def _open_or_create(uri: str, schema: pa.Schema) -> DeltaTable:
    if "AWS_S3_LOCKING_PROVIDER" not in os.environ:  # without a lock, delta-rs commits by put-if-absent
        conditional_probe.require_conditional_writes(uri)
    return open_or_create(uri, schema, list(PARTITION_COLUMNS))


def add_columns_if_missing(uri: str, schema: pa.Schema) -> list[str]:
    """Add ``schema``'s columns the table lacks (nullable; old nights read them as null); the names added.
    Only a metadata commit: no data file is rewritten. A changed type is refused."""
    uri = storage.normalize(uri)
    wanted = table_schema(schema)
    tbl = open_table(uri)
    current = arrow_schema(tbl)
    missing: list[pa.Field] = []
    for field in wanted:
        index = current.get_field_index(field.name)
        if index < 0:
            missing.append(field.with_nullable(True))
        elif not current.field(index).type.equals(field.type):
            raise ConfigError(
                f"column {field.name!r} of {uri} is {current.field(index).type}, not {field.type}: "
                "Delta columns cannot change type in place"
            )
    if not missing:
        return []
    fields: list[DeltaField] = DeltaSchema.from_arrow(pa.schema(missing)).fields
    with delta_errors("add columns to", uri):
        tbl.alter.add_columns(fields)
    return [field.name for field in missing]


def _relative_path(uri: str, file_uri: str, night: Night) -> str:
    file_uri = storage.normalize(file_uri)
    prefix = f"{uri}/{night.relative_dir}/"
    if not file_uri.startswith(prefix):
        raise InputDataError(f"{file_uri} is not under {prefix}: actors must write there for Delta to reference it")
    relative = file_uri[len(uri) + 1 :]
    if not _SAFE_PATH.match(relative):
        raise InputDataError(f"{file_uri}: file names need characters that Delta paths would have to encode")
    return relative


def _add_action(uri: str, file_uri: str, night: Night, columns: pa.Schema) -> tuple[AddAction, int]:
    relative = _relative_path(uri, file_uri, night)
    fs, path = storage.arrow_filesystem(storage.normalize(file_uri))
    with delta_errors("read the footer of", file_uri, pa.ArrowInvalid):
        info = fs.get_file_info(path)
        meta = pq.read_metadata(path, filesystem=fs)  # the footer only: rows are never re-read
    if info.size is None or info.mtime is None:
        raise InputDataError(f"{file_uri}: not found")
    stray = [
        name for name in meta.schema.to_arrow_schema().names if name in PARTITION_COLUMNS or name not in columns.names
    ]
    if stray:
        raise InputDataError(f"{file_uri} has columns {stray} that the table does not store in data files")
    stats = json.dumps({"numRecords": meta.num_rows, **_column_stats(meta)})
    modified_ms = int(info.mtime.timestamp() * 1000)
    return AddAction(relative, info.size, night.values, modified_ms, True, stats), meta.num_rows


def _column_stats(meta: pq.FileMetaData) -> dict[str, dict[str, Any]]:
    """Delta's per-file ``minValues``/``maxValues``/``nullCount`` of every plain top-level column, from the
    Parquet footer, so readers skip files by them. All of those columns or none: delta-rs's reader drops every
    row of a file whose statistics name some columns but not the one a filter is on."""
    plain = {
        meta.schema.column(i).path: i
        for i in range(meta.num_columns)
        if "." not in meta.schema.column(i).path  # a list column's leaf is "<name>.list.element"
    }
    found: dict[str, dict[str, Any]] = {"minValues": {}, "maxValues": {}, "nullCount": {}}
    for name, index in plain.items():
        groups = [meta.row_group(g).column(index).statistics for g in range(meta.num_row_groups)]
        if meta.num_rows == 0 or any(g is None or not g.has_min_max or not g.has_null_count for g in groups):
            return {}
        found["minValues"][name] = _json_value(min(g.min for g in groups))
        found["maxValues"][name] = _json_value(max(g.max for g in groups))
        found["nullCount"][name] = sum(g.null_count for g in groups)
    return found


def _json_value(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _night_seq(tbl: DeltaTable, night: Night) -> int:
    return tbl.transaction_version(night.app_id) or 0


def night_seq(uri: str, partition: Mapping[str, str] | Night) -> int:
    """How many times the night was committed (0 before its first commit or the table's): a run's ``expected_seq``."""
    uri = storage.normalize(uri)
    if not is_table(uri):
        return 0
    return _night_seq(open_table(uri), Night.of(partition))


def _taken_by_another(uri: str, tbl: DeltaTable, night: Night, seen_seq: int, run_id: str) -> NightCommittedElsewhere:
    winner = find_commit(uri, tbl, night)
    who = winner.run_id if winner else "another run"
    where = f" (version {winner.version})" if winner else ""
    return NightCommittedElsewhere(
        f"another run committed that night: {who} committed {night.model_name} {night.dt} in {uri}{where} "
        f"after run {run_id} read it (night commit {seen_seq}); {run_id}'s files stay uncommitted",
        winner_run_id=winner.run_id if winner else None,
    )


def check_night_unchanged(uri: str, partition: Mapping[str, str] | Night, expected_seq: int, run_id: str) -> None:
    """Raise :class:`NightCommittedElsewhere` when the night was committed since a run saw ``expected_seq``.
    The nightly run checks the predictions table (the night's done marker) this way before committing its
    errors, so a run that started while another was between its two commits stops before writing either."""
    uri = storage.normalize(uri)
    night = Night.of(partition)
    if not is_table(uri):
        if expected_seq == 0:
            return
        raise InputDataError(f"{uri} is not a Delta table any more (the run saw the night committed {expected_seq}x)")
    tbl = open_table(uri)
    if _night_seq(tbl, night) != expected_seq:
        raise _taken_by_another(uri, tbl, night, expected_seq, run_id)


def commit_night(
    uri: str,
    files: Iterable[str],
    partition: Mapping[str, str] | Night,
    run_id: str,
    schema: pa.Schema,
    *,
    expected_seq: int | None = None,
    record: NightCommit | None = None,
    max_attempts: int = 3,
) -> NightCommit:
    """Commit a night's Parquet files as one transaction replacing that (model_name, dt); the commit made.

    ``files`` are already written in the night's folder (:func:`data_file_uri`); ``schema`` is the data
    schema. The table is created, and missing columns are added, first. A second call with the same ``run_id``
    is a no-op that returns the commit found. Raises :class:`NightCommittedElsewhere` when another run committed
    the night since the run read :func:`night_seq` as ``expected_seq`` (when given, else since this call's
    snapshot). ``record`` is the run's record for the commit's info; this function sets the night's own fields.
    """
    uri = storage.normalize(uri)
    night = Night.of(partition)
    check_run_id(run_id)
    wanted = table_schema(schema)
    tbl = _open_or_create(uri, wanted)
    if tbl.transaction_version(night.run_app_id(run_id)) is not None:
        return _already(uri, tbl, night, run_id)
    if add_columns_if_missing(uri, wanted):
        tbl = open_table(uri)
    seen_seq = _night_seq(tbl, night) if expected_seq is None else expected_seq
    added = [_add_action(uri, file_uri, night, wanted) for file_uri in files]
    own = {"run_id": run_id, **night.values, "files": len(added), "rows": sum(rows for _, rows in added)}
    described = (record or NightCommit(run_id=run_id, model_name=night.model_name, dt=night.dt)).model_copy(update=own)
    for attempt in range(1, max_attempts + 1):
        if attempt > 1:
            tbl = open_table(uri)
            if tbl.transaction_version(night.run_app_id(run_id)) is not None:
                return _already(uri, tbl, night, run_id)  # our own earlier attempt landed after all
        seq = _night_seq(tbl, night)
        if seq != seen_seq:
            raise _taken_by_another(uri, tbl, night, seen_seq, run_id)
        commit = described.model_copy(update={"night_seq": seq + 1})
        if _try_commit(uri, tbl, night, [action for action, _ in added], commit, last=attempt == max_attempts):
            # the handle does not follow its own commit: the version lies between its snapshot and now
            latest = open_table(uri).version()
            version = commit_version(uri, night.run_app_id(run_id), tbl.version() + 1, latest, tbl.version())
            return commit.model_copy(update={"version": version})
    raise AssertionError("unreachable")  # the loop returns or raises


def _try_commit(
    uri: str, tbl: DeltaTable, night: Night, actions: Sequence[AddAction], commit: NightCommit, last: bool
) -> bool:
    """One attempt at the night's overwrite; False on a conflict, for the caller to tell a lost race from an
    unrelated one by reading the table again (on the ``last`` attempt, the conflict is raised)."""
    # the run's transaction carries the night's count too: its current run, without the history
    seq = commit.night_seq
    transactions = [Transaction(night.app_id, seq), Transaction(night.run_app_id(commit.run_id), seq)]
    try:
        tbl.create_write_transaction(
            list(actions),
            "overwrite",
            arrow_schema(tbl),
            partition_by=list(PARTITION_COLUMNS),
            partition_filters=night.filters,
            commit_properties=CommitProperties(custom_metadata=commit.to_metadata(), app_transactions=transactions),
            # also for tables created elsewhere without TABLE_CONFIGURATION
            post_commithook_properties=PostCommitHookProperties(cleanup_expired_logs=False),
        )
    except CommitFailedError as exc:
        if last:
            raise TransientStorageError(f"commit {night.relative_dir} to {uri}: {exc}") from exc
        return False
    except (DeltaError, OSError) as exc:
        raise storage_error(exc, f"commit {night.relative_dir} to", uri) from exc
    return True


def _already(uri: str, tbl: DeltaTable, night: Night, run_id: str) -> NightCommit:
    committed = find_commit(uri, tbl, night, run_id)
    if committed is None:  # its info unread: only where it is
        version = commit_version(uri, night.run_app_id(run_id), -1, tbl.version())
        committed = NightCommit(run_id=run_id, model_name=night.model_name, dt=night.dt, version=version)
    return committed.model_copy(update={"already_committed": True})
