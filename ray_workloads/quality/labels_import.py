"""Labels come back: a file of people's answers checked against what the model predicted, then appended.

A label names a photo by ``uri`` (or ``key``, under a base prefix) and optionally the ``etag`` it saw,
and gives a ``label`` from the model's class list (its name, or its index). It is refused when rayline
never predicted that photo for the model (``unknown_uri``), when its ETag is not the photo's newest
predicted one (``stale_etag``), when its class is not one of the model's (``unknown_class``), when it has
no label (``missing_label``) or a ``labelled_at`` that is not ISO 8601 (``bad_labelled_at``), or when the
file labels one photo twice differently (``conflicting``). Refused rows go to a CSV beside the import,
with their line and reason. Rows the table already holds (same photo, same class) are ``already_labelled``.

The answer comes from the commit (:class:`rayline.tables.labels.ImportOutcome` in its info): a retry of
the run that committed the file (``run_id``) reports what that commit added; any other run, "imported
before", nothing added.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections import Counter
from datetime import UTC, datetime
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError
from pydantic import BaseModel, Field, field_validator

from rayline import storage
from rayline.errors import InputDataError
from rayline.lineage import DatasetRef
from rayline.storage.layout import LABEL_IMPORTS_DIR, PREDICTIONS_TABLE, table_uri
from rayline.tables import labels as labels_table
from rayline.tables.delta_tables import open_table, storage_error, storage_options

Reason = Literal["unknown_uri", "stale_etag", "unknown_class", "missing_label", "bad_labelled_at", "conflicting"]
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
OPTIONAL_COLUMNS = ("etag", "source", "labelled_at")


class LabelsImportConfig(BaseModel):
    file_uri: str = Field(description="The labels file: CSV, Parquet or JSON Lines, by its suffix.")
    root: str = Field(description="The storage root: the predictions and labels tables live there.")
    model_name: str
    classes: list[str] = Field(description="The model's class list: a label is one of these, or its index.")
    key_base: str = Field(description="What a ``key`` column is relative to (default <storage>/incoming).")
    source: str | None = Field(None, description="Who labelled, for rows without a ``source`` column.")
    selection: Literal["random"] | None = Field(
        None, description="random: the photos were chosen whatever the models answered, so may judge a challenger."
    )
    run_id: str | None = Field(
        None, description="The importing flow run: a retry within it reports what its first attempt committed."
    )

    @field_validator("file_uri", "root", "key_base")
    @classmethod
    def _normalized(cls, uri: str) -> str:
        return storage.normalize(uri)  # a local path made absolute: the same file whatever the cwd later


class LabelsImportResult(BaseModel):
    model_name: str
    file_uri: str
    import_id: str = Field(description="The file's SHA-256: importing the same file again adds nothing.")
    rows_read: int
    imported: int = Field(description="Labels appended by this import (0 when it was imported before).")
    already_labelled: int = Field(0, description="Rows the table held already: same photo, same class.")
    rejected: dict[str, int] = Field(default_factory=dict, description="Refused rows by reason.")
    rejected_uri: str | None = Field(None, description="The refused rows, each with its line and reason (CSV).")
    already_imported: bool = False
    labels_table_uri: str
    labels_version: int | None = Field(None, description="The labels table's version holding this import.")
    predictions_version: int | None = Field(None, description="The predictions table version checked against.")

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def lineage_inputs(self) -> list[DatasetRef]:
        refs = [DatasetRef(uri=self.file_uri, content_hash=f"sha256:{self.import_id}")]
        if self.predictions_version is not None:
            predictions = table_uri(self.labels_table_uri.rsplit("/", 1)[0], PREDICTIONS_TABLE)
            version = self.predictions_version
            refs.append(
                DatasetRef(uri=predictions, facets={"version": version}, stored_as="delta", table_version=version)
            )
        return refs

    def lineage_outputs(self) -> list[DatasetRef]:
        if self.labels_version is None:
            return []
        facets = {"version": self.labels_version, "model_name": self.model_name, "rows": self.imported}
        version = self.labels_version
        return [DatasetRef(uri=self.labels_table_uri, facets=facets, stored_as="delta", table_version=version)]


def run(cfg: LabelsImportConfig) -> LabelsImportResult:
    """Read, check and append one labels file (the module docstring says what is refused)."""
    body = storage.read_bytes(cfg.file_uri)
    import_id = hashlib.sha256(body).hexdigest()
    rows = read_label_file(cfg.file_uri, body)
    done = labels_table.committed_import(cfg.root, cfg.model_name, import_id)
    if done is not None:
        return _reported(cfg, import_id, rows.num_rows, done)
    uris = _uris(rows, cfg.key_base)
    predicted, predictions_version = newest_predicted_etags(cfg.root, cfg.model_name, sorted(set(uris)))
    checked = check_rows(rows, uris, predicted, cfg.classes)
    held = _held(labels_table.read_labels(cfg.root, cfg.model_name))
    fresh = [r for r in checked.accepted if (r["uri"], r["etag"], r["label_index"]) not in held]
    outcome = labels_table.ImportOutcome(
        run_id=cfg.run_id,
        imported=len(fresh),
        already_labelled=len(checked.accepted) - len(fresh),
        rejected=dict(sorted(Counter(r["reason"] for r in checked.rejected).items())),
        rejected_uri=_write_rejected(cfg, import_id, checked.rejected) if checked.rejected else None,
        predictions_version=predictions_version,
    )
    if not fresh:
        return _answer(cfg, import_id, rows.num_rows, outcome, labels_version=None)
    labelled = _labels_rows(fresh, cfg, import_id, datetime.now(UTC))
    commit = labels_table.append_labels(cfg.root, cfg.model_name, import_id, labelled, cfg.file_uri, outcome)
    return _reported(cfg, import_id, rows.num_rows, commit)


def _reported(
    cfg: LabelsImportConfig, import_id: str, rows_read: int, commit: labels_table.LabelsCommit
) -> LabelsImportResult:
    """The answer a commit gives: its outcome when this run made it (now or before this retry), else none added."""
    outcome = commit.outcome
    same_run = outcome is not None and cfg.run_id is not None and cfg.run_id == outcome.run_id  # None: no run
    ours = outcome is not None and (not commit.already_imported or same_run)
    return _answer(cfg, import_id, rows_read, outcome if ours else None, labels_version=commit.version)


def _answer(
    cfg: LabelsImportConfig,
    import_id: str,
    rows_read: int,
    outcome: labels_table.ImportOutcome | None,
    labels_version: int | None,
) -> LabelsImportResult:
    """The result of ``outcome``; None: the file was imported before, and this run added nothing."""
    counts = {"imported": 0} if outcome is None else outcome.model_dump(exclude={"run_id"})
    return LabelsImportResult(
        model_name=cfg.model_name,
        file_uri=cfg.file_uri,
        import_id=import_id,
        rows_read=rows_read,
        already_imported=outcome is None,
        labels_table_uri=labels_table.labels_uri(cfg.root),
        labels_version=labels_version,
        **counts,
    )


def read_label_file(file_uri: str, body: bytes) -> pa.Table:
    """The file's rows with every column as text, checked for ``label`` and one of ``uri``/``key``."""
    suffix = "." + file_uri.rsplit(".", 1)[-1].lower() if "." in file_uri.rsplit("/", 1)[-1] else ""
    kind = FORMATS.get(suffix)
    if kind is None:
        raise InputDataError(f"{file_uri}: a labels file is CSV, Parquet or JSON Lines ({', '.join(FORMATS)})")
    try:
        if kind == "csv":  # every column as text: an ETag of hex digits must not become a number
            header = next(csv.reader(io.StringIO(body.decode("utf-8-sig").split("\n", 1)[0])), [])
            text = pa_csv.ConvertOptions(column_types={name: pa.string() for name in header})
            table = pa_csv.read_csv(io.BytesIO(body), convert_options=text)
        elif kind == "parquet":
            table = pq.read_table(io.BytesIO(body))
        else:
            table = pa_json.read_json(io.BytesIO(body))
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as exc:
        raise InputDataError(f"{file_uri} is not readable as {kind}: {exc}") from exc
    names = set(table.column_names)
    if "label" not in names or not names & {"uri", "key"}:
        raise InputDataError(
            f"{file_uri} has columns {sorted(names)}; a labels file needs 'label' and 'uri' or 'key' "
            f"(optionally {', '.join(OPTIONAL_COLUMNS)})"
        )
    if table.num_rows == 0:
        raise InputDataError(f"{file_uri} holds no labels")
    return pa.table({name: _as_text(table[name]) for name in table.column_names})


def _as_text(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Every column as text (a timestamp as ISO 8601): the checks read labels, ETags and times alike."""
    return column if pa.types.is_string(column.type) else column.cast(pa.string())


def _uris(rows: pa.Table, key_base: str) -> list[str]:
    uris = rows["uri"].to_pylist() if "uri" in rows.column_names else [None] * rows.num_rows
    keys = rows["key"].to_pylist() if "key" in rows.column_names else [None] * rows.num_rows
    return [
        storage.normalize(uri) if uri else storage.join(key_base, key.lstrip("/")) if key else ""
        for uri, key in zip(uris, keys, strict=True)
    ]


def newest_predicted_etags(root: str, model_name: str, uris: list[str]) -> tuple[dict[str, str], int | None]:
    """For each of ``uris`` the model predicted, the ETag of its newest night; and the table version read."""
    uri = table_uri(root, PREDICTIONS_TABLE)
    if not uris or not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return {}, None
    tbl = open_table(uri)
    try:
        found = tbl.to_pyarrow_dataset(file_pruning_predicate=[("model_name", "=", model_name)]).to_table(
            columns=["uri", "etag", "dt"],
            filter=(pc.field("model_name") == model_name) & pc.field("uri").isin(uris),
            use_threads=False,
        )
    except (DeltaError, OSError) as exc:
        raise storage_error(exc, "read", uri) from exc
    newest: dict[str, tuple[str, str]] = {}
    for row_uri, etag, dt in zip(*(found[c].to_pylist() for c in ("uri", "etag", "dt")), strict=True):
        if row_uri not in newest or dt > newest[row_uri][0]:
            newest[row_uri] = (dt, etag)
    return {u: etag for u, (_, etag) in newest.items()}, tbl.version()


class CheckedRows(BaseModel):
    accepted: list[dict[str, Any]]
    rejected: list[dict[str, Any]]


def check_rows(rows: pa.Table, uris: list[str], predicted: dict[str, str], classes: list[str]) -> CheckedRows:
    """Each row accepted (uri, etag, label, index, source, labelled_at) or refused with its reason."""
    index_of = {name: i for i, name in enumerate(classes)}
    accepted: dict[tuple[str, str], dict[str, Any]] = {}
    rejected: list[dict[str, Any]] = []
    conflicted: set[tuple[str, str]] = set()
    columns = {name: rows[name].to_pylist() for name in rows.column_names}
    for i, uri in enumerate(uris):
        line = i + 1
        raw_label = (columns["label"][i] or "").strip()
        given_etag = (columns["etag"][i] or "").strip().strip('"') if "etag" in columns else ""
        labelled_at = (columns["labelled_at"][i] or "").strip() if "labelled_at" in columns else ""
        reason, detail = _refusal(uri, raw_label, given_etag, predicted, index_of, classes)
        if reason is None and labelled_at and _parsed_time(labelled_at) is None:
            reason, detail = "bad_labelled_at", f"{labelled_at!r} is not an ISO 8601 time (2026-12-01T09:30:00Z)"
        if reason is not None:
            rejected.append({"row": line, "uri": uri, "label": raw_label, "reason": reason, "detail": detail})
            continue
        index = class_index(raw_label, index_of, len(classes))
        assert index is not None  # _refusal refused every label without one
        row = {
            "row": line,
            "uri": uri,
            "etag": predicted[uri],
            "label": classes[index],
            "label_index": index,
            "source": (columns["source"][i] or None) if "source" in columns else None,
            "labelled_at": _parsed_time(labelled_at) if labelled_at else None,
        }
        key = (uri, predicted[uri])
        if key in accepted and accepted[key]["label_index"] != index:
            conflicted.add(key)
        accepted.setdefault(key, row)
    for key in conflicted:
        first = accepted.pop(key)
        detail = "the file gives this photo two different labels: fix the file and import it again"
        rejected.append({"row": first["row"], "uri": key[0], "label": first["label"], "reason": "conflicting",
                         "detail": detail})  # fmt: skip
    return CheckedRows(accepted=list(accepted.values()), rejected=sorted(rejected, key=lambda r: r["row"]))


def _refusal(
    uri: str, label: str, etag: str, predicted: dict[str, str], index_of: dict[str, int], classes: list[str]
) -> tuple[Reason | None, str]:
    if not uri:
        return "unknown_uri", "the row has neither a uri nor a key"
    if uri not in predicted:
        return "unknown_uri", "the model never predicted this photo: label photos from its nights"
    if etag and etag != predicted[uri]:
        return "stale_etag", f"labelled ETag {etag}, but the newest prediction is of ETag {predicted[uri]}"
    if not label:
        return "missing_label", "the row has no label"
    if class_index(label, index_of, len(classes)) is None:
        return (
            "unknown_class",
            f"not one of the model's {len(classes)} classes (a name, or an index 0-{len(classes) - 1})",
        )
    return None, ""


def class_index(label: str, index_of: dict[str, int], count: int) -> int | None:
    """The class ``label`` names: a class name, or an ASCII decimal index below ``count``; None for anything else
    (not ``str.isdigit``: it holds for superscripts and other scripts' digits, ``"²"``, full-width ``"１"``)."""
    if label in index_of:
        return index_of[label]
    if label.isascii() and label.isdecimal() and int(label) < count:
        return int(label)
    return None


def _held(existing: pa.Table) -> set[tuple[str, str, int]]:
    """The (uri, etag, class index) of every label the table holds now."""
    columns = (existing[name].to_pylist() for name in ("uri", "etag", "label_index"))
    return set(zip(*columns, strict=True))


def _labels_rows(rows: list[dict[str, Any]], cfg: LabelsImportConfig, import_id: str, now: datetime) -> pa.Table:
    """The accepted rows as ``LABELS_SCHEMA`` rows (their ``row`` number dropped), ``cfg``'s marks on each."""
    marks = {"import_id": import_id, "selection": cfg.selection, "model_name": cfg.model_name}
    return pa.Table.from_pylist(
        [{**r, "source": r["source"] or cfg.source, "labelled_at": r["labelled_at"] or now, **marks} for r in rows],
        schema=labels_table.LABELS_SCHEMA,
    )


def _parsed_time(text: str) -> datetime | None:
    """An ISO 8601 time, in UTC when it names no zone; None when it is not one."""
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _write_rejected(cfg: LabelsImportConfig, import_id: str, rejected: list[dict[str, Any]]) -> str:
    """The refused rows as CSV under ``label_imports/<model>/<import id>/``: what to fix, line by line."""
    uri = storage.join(storage.normalize(cfg.root), LABEL_IMPORTS_DIR, cfg.model_name, import_id, "rejected.csv")
    table = pa.table({name: [str(r[name]) for r in rejected] for name in ("row", "uri", "label", "reason", "detail")})
    sink = io.BytesIO()
    pa_csv.write_csv(table, sink)
    storage.write_bytes_atomic(uri, sink.getvalue())
    return uri
