"""The ``labels`` Delta table: people's answers for photos a model predicted, keyed like its predictions.

A row names a photo as it was predicted, ``(uri, etag)``, and its class (``label``, ``label_index`` in
the model's class list), partitioned by ``model_name``. ``selection`` is ``random`` when the import said its
photos were chosen uniformly at random, whatever the models answered (empty otherwise: a queue's random draw
is recorded with the queue). Each import appends once: its id (the file's
SHA-256) is a Delta app transaction, so importing the same file again commits nothing, and two imports
never interleave rows. A photo labelled twice keeps its newest label (:func:`read_labels`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction, write_deltalake
from deltalake.exceptions import DeltaError

from rayline.errors import InputDataError
from rayline.storage.layout import LABELS_TABLE, table_uri
from rayline.tables import delta_log
from rayline.tables.delta_tables import (
    SAFE_NAME,
    commit_version,
    open_or_create,
    open_table,
    storage_error,
    storage_options,
)

LABELS_SCHEMA = pa.schema(
    [
        ("uri", pa.string()),
        ("etag", pa.string()),
        ("label", pa.string()),
        ("label_index", pa.int64()),
        ("source", pa.string()),
        ("labelled_at", pa.timestamp("us", tz="UTC")),
        ("import_id", pa.string()),
        ("selection", pa.string()),
        ("model_name", pa.string()),
    ]
)
RANDOM = "random"
KEY = ("uri", "etag")


@dataclass(frozen=True)
class LabelsCommit:
    """The table version holding an import, and whether an earlier run had committed it already."""

    version: int
    already_imported: bool


def labels_uri(root: str) -> str:
    return table_uri(root, LABELS_TABLE)


def _app_id(model_name: str, import_id: str) -> str:
    if not SAFE_NAME.match(import_id):
        raise InputDataError(f"import id {import_id!r} is not usable as a Delta app id")
    return f"rayline-labels/{model_name}/{import_id}"


def imported_version(root: str, model_name: str, import_id: str) -> int | None:
    """The table version that committed ``import_id`` for ``model_name``; None when it never was."""
    uri = labels_uri(root)
    if not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return None
    tbl = open_table(uri)
    app_id = _app_id(model_name, import_id)
    if tbl.transaction_version(app_id) is None:
        return None
    setting = delta_log.version_setting(uri, app_id, 1, tbl.version())
    return setting if setting is not None else commit_version(uri, app_id, -1, tbl.version())


def append_labels(root: str, model_name: str, import_id: str, rows: pa.Table, source_uri: str) -> LabelsCommit:
    """Append one import's rows (``LABELS_SCHEMA``) in one commit; a second call with the same id adds nothing."""
    uri = labels_uri(root)
    tbl = open_or_create(uri, LABELS_SCHEMA, ["model_name"])
    app_id = _app_id(model_name, import_id)
    if tbl.transaction_version(app_id) is not None:
        version = imported_version(root, model_name, import_id)
        return LabelsCommit(version=version if version is not None else tbl.version(), already_imported=True)
    properties = CommitProperties(
        custom_metadata={
            "rayline.labels_import": app_id,
            "rayline.source": source_uri,
            "rayline.rows": rows.num_rows,
        },
        app_transactions=[Transaction(app_id, 1)],
    )
    try:
        write_deltalake(
            tbl,
            rows.select(LABELS_SCHEMA.names).cast(LABELS_SCHEMA),
            mode="append",
            schema_mode="merge",  # a table made before a column was added takes it with this import
            partition_by=["model_name"],
            commit_properties=properties,
            post_commithook_properties=PostCommitHookProperties(cleanup_expired_logs=False),
        )
    except (DeltaError, OSError) as exc:
        raise storage_error(exc, "append labels to", uri) from exc
    version = imported_version(root, model_name, import_id)
    return LabelsCommit(version=version if version is not None else open_table(uri).version(), already_imported=False)


def current_version(root: str) -> int | None:
    """The labels table's version now; None before its first import."""
    uri = labels_uri(root)
    if not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return None
    return open_table(uri).version()


def read_labels(root: str, model_name: str, version: int | None = None) -> pa.Table:
    """``model_name``'s labels, the newest per ``(uri, etag)`` (by ``labelled_at``, then commit order)."""
    uri = labels_uri(root)
    if not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return LABELS_SCHEMA.empty_table()
    tbl = open_table(uri, version)
    try:
        rows = tbl.to_pyarrow_dataset(file_pruning_predicate=[("model_name", "=", model_name)]).to_table(
            filter=pc.field("model_name") == model_name, use_threads=False
        )
    except (DeltaError, OSError) as exc:
        raise storage_error(exc, "read", uri) from exc
    return newest_per_photo(with_schema(rows))


def with_schema(rows: pa.Table) -> pa.Table:
    """``rows`` as ``LABELS_SCHEMA``; a column that files written before it lack is null."""
    missing = [f for f in LABELS_SCHEMA if f.name not in rows.column_names]
    for missing_field in missing:
        rows = rows.append_column(missing_field, pa.nulls(rows.num_rows, missing_field.type))
    return rows.select(LABELS_SCHEMA.names).cast(LABELS_SCHEMA)


def photos_of_imports(root: str, model_name: str, import_ids: list[str]) -> frozenset[tuple[str, str]]:
    """The (uri, etag) of every photo the imports ``import_ids`` labelled (whatever labels came later)."""
    uri = labels_uri(root)
    if not import_ids or not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return frozenset()
    try:
        rows = (
            open_table(uri)
            .to_pyarrow_dataset(file_pruning_predicate=[("model_name", "=", model_name)])
            .to_table(
                columns=["uri", "etag"],
                filter=(pc.field("model_name") == model_name) & pc.field("import_id").isin(import_ids),
                use_threads=False,
            )
        )
    except (DeltaError, OSError) as exc:
        raise storage_error(exc, "read", uri) from exc
    return frozenset(zip(rows["uri"].to_pylist(), rows["etag"].to_pylist(), strict=True))


def newest_per_photo(rows: pa.Table) -> pa.Table:
    """One row per ``(uri, etag)``: the one labelled last (a later row wins a tie)."""
    if rows.num_rows == 0:
        return rows
    order = pa.array(range(rows.num_rows), pa.int64())
    ranked = rows.append_column("_order", order).sort_by([("labelled_at", "ascending"), ("_order", "ascending")])
    ranked = ranked.append_column("_rank", pa.array(range(ranked.num_rows), pa.int64()))
    last = ranked.group_by(list(KEY), use_threads=False).aggregate([("_rank", "max")])
    keep = pc.is_in(ranked["_rank"], value_set=last["_rank_max"])
    return ranked.filter(keep).drop_columns(["_order", "_rank"]).sort_by([("uri", "ascending"), ("etag", "ascending")])
