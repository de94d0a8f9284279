"""The ``labels`` Delta table: people's answers for photos a model predicted, keyed like its predictions.

A row names a photo as it was predicted, ``(uri, etag)``, and its class (``label``, ``label_index`` in the
model's class list), partitioned by ``model_name``. ``selection`` is ``random`` when the import said its photos
were chosen uniformly at random, whatever the models answered (empty otherwise: a queue's random draw is
recorded with the queue). Each import appends once: its id (the file's SHA-256) is a Delta app transaction, so
importing the same file again commits nothing, and two imports never interleave rows. The commit's info keeps
what the import added and refused, and the run that made it (:class:`ImportOutcome`): a retry of that run finds
its answer there. A photo labelled twice keeps its newest label (:func:`read_labels`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, PostCommitHookProperties, Transaction, write_deltalake
from pydantic import BaseModel

from rayline.errors import InputDataError
from rayline.storage.layout import LABELS_TABLE, table_uri
from rayline.tables import delta_log
from rayline.tables.delta_tables import (
    SAFE_NAME,
    commit_version,
    delta_errors,
    is_table,
    open_or_create,
    open_table,
    table_version,
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


class ImportOutcome(BaseModel):
    """What one labels import added and refused, and the run that imported it: kept in its commit's info.
    ``run_id`` (a Prefect flow run id; None outside one) tells a retry of the importing run, which reports
    this outcome as its own, from a later run importing the same file, which added nothing."""

    METADATA_KEY: ClassVar[str] = "rayline.labels_outcome"

    run_id: str | None
    imported: int
    already_labelled: int
    rejected: dict[str, int]
    rejected_uri: str | None
    predictions_version: int | None

    def to_metadata(self) -> dict[str, str]:
        return {self.METADATA_KEY: self.model_dump_json()}

    @classmethod
    def from_metadata(cls, info: Mapping[str, Any]) -> ImportOutcome | None:
        """The outcome a commit info holds; None for commits made before outcomes were kept."""
        raw = info.get(cls.METADATA_KEY)
        return None if raw is None else cls.model_validate_json(raw)


@dataclass(frozen=True)
class LabelsCommit:
    """The table version holding an import, whether an earlier attempt or run had committed it already, and
    what the commit recorded of it (None when its info is gone or predates outcomes)."""

    version: int
    already_imported: bool
    outcome: ImportOutcome | None = None


def labels_uri(root: str) -> str:
    return table_uri(root, LABELS_TABLE)


def _app_id(model_name: str, import_id: str) -> str:
    if not SAFE_NAME.match(import_id):
        raise InputDataError(f"import id {import_id!r} is not usable as a Delta app id")
    return f"rayline-labels/{model_name}/{import_id}"


def imported_version(root: str, model_name: str, import_id: str) -> int | None:
    """The table version that committed ``import_id`` for ``model_name``; None when it never was."""
    uri = labels_uri(root)
    if not is_table(uri):
        return None
    tbl = open_table(uri)
    app_id = _app_id(model_name, import_id)
    if tbl.transaction_version(app_id) is None:
        return None
    setting = delta_log.version_setting(uri, app_id, 1, tbl.version())
    return setting if setting is not None else commit_version(uri, app_id, -1, tbl.version())


def committed_import(root: str, model_name: str, import_id: str) -> LabelsCommit | None:
    """The commit of ``import_id`` for ``model_name``, with the outcome its info recorded; None when none."""
    version = imported_version(root, model_name, import_id)
    if version is None:
        return None
    info = delta_log.commit_info(labels_uri(root), version)
    outcome = ImportOutcome.from_metadata(info) if info is not None else None
    return LabelsCommit(version=version, already_imported=True, outcome=outcome)


def append_labels(
    root: str, model_name: str, import_id: str, rows: pa.Table, source_uri: str, outcome: ImportOutcome
) -> LabelsCommit:
    """Append one import's rows (``LABELS_SCHEMA``) in one commit, its ``outcome`` in the commit's info;
    a second call with the same id adds nothing and returns the first's commit."""
    uri = labels_uri(root)
    tbl = open_or_create(uri, LABELS_SCHEMA, ["model_name"])
    app_id = _app_id(model_name, import_id)
    if tbl.transaction_version(app_id) is not None:
        found = committed_import(root, model_name, import_id)
        return found if found is not None else LabelsCommit(version=tbl.version(), already_imported=True)
    properties = CommitProperties(
        custom_metadata={
            "rayline.labels_import": app_id,
            "rayline.source": source_uri,
            "rayline.rows": rows.num_rows,
            **outcome.to_metadata(),
        },
        app_transactions=[Transaction(app_id, 1)],
    )
    with delta_errors("append labels to", uri):
        write_deltalake(
            tbl,
            rows.select(LABELS_SCHEMA.names).cast(LABELS_SCHEMA),
            mode="append",
            schema_mode="merge",  # a table made before a column was added takes it with this import
            partition_by=["model_name"],
            commit_properties=properties,
            post_commithook_properties=PostCommitHookProperties(cleanup_expired_logs=False),
        )
    version = imported_version(root, model_name, import_id)  # the read after the append
    version = version if version is not None else open_table(uri).version()
    return LabelsCommit(version=version, already_imported=False, outcome=outcome)


def current_version(root: str) -> int | None:
    """The labels table's version now; None before its first import."""
    return table_version(labels_uri(root))


def read_labels(root: str, model_name: str, version: int | None = None) -> pa.Table:
    """``model_name``'s labels, the newest per ``(uri, etag)`` (by ``labelled_at``, then commit order)."""
    uri = labels_uri(root)
    if not is_table(uri):
        return LABELS_SCHEMA.empty_table()
    tbl = open_table(uri, version)
    with delta_errors("read", uri):
        rows = tbl.to_pyarrow_dataset(file_pruning_predicate=[("model_name", "=", model_name)]).to_table(
            filter=pc.field("model_name") == model_name, use_threads=False
        )
    return newest_per_photo(with_schema(rows))


def with_schema(rows: pa.Table) -> pa.Table:
    """``rows`` as ``LABELS_SCHEMA``; a column that files written before it lack is null."""
    for missing in [f for f in LABELS_SCHEMA if f.name not in rows.column_names]:
        rows = rows.append_column(missing, pa.nulls(rows.num_rows, missing.type))
    return rows.select(LABELS_SCHEMA.names).cast(LABELS_SCHEMA)


def photos_of_imports(root: str, model_name: str, import_ids: list[str]) -> frozenset[tuple[str, str]]:
    """The (uri, etag) of every photo the imports ``import_ids`` labelled (whatever labels came later)."""
    uri = labels_uri(root)
    if not import_ids or not is_table(uri):
        return frozenset()
    with delta_errors("read", uri):
        rows = (
            open_table(uri)
            .to_pyarrow_dataset(file_pruning_predicate=[("model_name", "=", model_name)])
            .to_table(
                columns=["uri", "etag"],
                filter=(pc.field("model_name") == model_name) & pc.field("import_id").isin(import_ids),
                use_threads=False,
            )
        )
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
