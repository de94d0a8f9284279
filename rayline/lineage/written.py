"""What a run wrote, read back from storage: each dataset's columns (its schema) and its rows, bytes and files.

A stage's result declares how each dataset it read or wrote is stored (``DatasetRef.stored_as``); the schema
comes from what was written, never from what the code meant to write: a Delta table's schema at the version
of the run's commit and that commit's ``add`` actions, a Parquet footer, a manifest's files, a registry
version's record. These are small reads (a log entry, a footer, a manifest) whatever the data's size.
"""

from __future__ import annotations

import io
import json
import posixpath
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from rayline import storage
from rayline.errors import RaylineError, StorageError
from rayline.lineage.records import Column, DatasetRef, Written
from rayline.models import registry
from rayline.storage import manifests
from rayline.storage.manifests import IngestManifest, LabelledExportManifest, PreprocessManifest
from rayline.tables import delta_log, delta_tables

# a manifest's data files of this name hold rows of another shape than the data (preprocess' failed images)
_ERRORS_SPLIT = "errors"


def describe(ref: DatasetRef, *, statistics: bool = True) -> Written | None:
    """``ref``'s columns and (``statistics``) what it holds, read from storage; None when it declares no layout.

    Raises a :class:`~rayline.errors.RaylineError` (a :class:`~rayline.errors.StorageError` for what the store,
    pyarrow or delta-rs raised) when what it names cannot be read.
    """
    if ref.stored_as is None:
        return None
    uri = storage.normalize(ref.uri)
    try:
        if ref.stored_as == "delta":
            return _delta(uri, ref.table_version, statistics)
        found = _READERS[ref.stored_as](uri)
        return found if statistics else Written(columns=found.columns)
    except RaylineError:
        raise
    except Exception as exc:  # each store's client, pyarrow and delta-rs raise their own classes
        raise storage.storage_error(exc, "reading back", uri) from exc


def _model(uri: str) -> Written:
    return Written(columns=model_signature(registry.version_at(uri)), **_sizes(storage.list_objects(uri)))


def _alias(uri: str) -> Written:
    """A version a run moved an alias to: it wrote nothing into the version's folder."""
    return Written(columns=model_signature(registry.version_at(uri)), bytes=0, files=0)


def arrow_columns(schema: pa.Schema | pa.StructType) -> list[Column]:
    """Arrow's fields as columns, struct fields (and those of a list of structs) nested."""
    return [
        _arrow_column(schema.field(i))
        for i in range(len(schema) if isinstance(schema, pa.Schema) else schema.num_fields)
    ]


def _arrow_column(field: pa.Field) -> Column:
    kind = field.type
    while pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    nested = arrow_columns(kind) if pa.types.is_struct(kind) else []
    return Column(name=field.name, type=_type_name(field.type), fields=nested)


def _type_name(kind: pa.DataType) -> str:
    """Arrow's name of a type; a tensor extension type (Ray Data's images) as ``float32[3,32,32]``."""
    shape = getattr(kind, "shape", None)
    if not isinstance(kind, pa.BaseExtensionType) or shape is None:
        return str(kind)
    storage = kind.storage_type
    scalar = getattr(kind, "value_type", None) or getattr(storage, "value_type", storage)
    dims = ",".join("?" if d is None else str(d) for d in shape)
    return f"{scalar.to_pandas_dtype().__name__}[{dims}]"


def model_signature(version: registry.ModelVersion) -> list[Column]:
    """A registry version's input and output, as a consumer calls it: the decoded image, one score per class."""
    spec, classes = version.image_spec, version.classes
    shown = ", ".join(classes[:10]) + (f", … ({len(classes)} classes)" if len(classes) > 10 else "")
    return [
        Column(name="image", type=f"float32[3,{spec.crop},{spec.crop}]", description=spec.describe()),
        Column(name="scores", type=f"float32[{len(classes)}]", description=f"one per class: {shown}"),
    ]


def _delta(uri: str, version: int | None, statistics: bool) -> Written:
    if version is None:
        raise StorageError(f"{uri} is declared a Delta table without the version of the run's commit")
    columns = arrow_columns(delta_tables.arrow_schema(delta_tables.open_table(uri, version)))
    if not statistics:
        return Written(columns=columns)
    added = delta_log.commit_files(uri, version)
    if added is None:  # the commit file is gone (log cleanup): the schema still stands
        return Written(columns=columns)
    counts = [json.loads(a["stats"]).get("numRecords") if a.get("stats") else None for a in added]
    rows = None if None in counts else sum(int(c) for c in counts if c is not None)
    return Written(columns=columns, rows=rows, bytes=sum(int(a.get("size", 0)) for a in added), files=len(added))


def _manifest(uri: str) -> Written:
    kind = storage.read_json(uri).get("kind")
    if kind == IngestManifest.model_fields["kind"].default:
        shards = manifests.read(uri, IngestManifest).shards
        columns = _parquet_columns(shards[0].uri) if shards else []
        return Written(
            columns=columns, rows=sum(s.rows for s in shards), bytes=sum(s.bytes for s in shards), files=len(shards)
        )
    if kind == PreprocessManifest.model_fields["kind"].default:
        summary = manifests.read(uri, PreprocessManifest).summary
        data = [f for split, files in summary.files.items() if split != _ERRORS_SPLIT for f in files]
        every = [f for files in summary.files.values() for f in files]
        rows = sum(summary.counts.values()) + summary.error_count
        return Written(
            columns=_parquet_columns(data[0]) if data else [], rows=rows, bytes=_total_size(every), files=len(every)
        )
    if kind == LabelledExportManifest.model_fields["kind"].default:
        copies = manifests.read(uri, LabelledExportManifest).copies
        columns = [Column(name="copy", type="string", description="<class>/<file> in the exported folder")]
        columns += [Column(name=name, type="string") for name in ("uri", "etag", "label")]
        return Written(columns=columns, rows=len(copies), files=len(copies))
    raise StorageError(f"{uri} is no manifest rayline reads back (kind {kind!r})")


def _parquet_columns(uri: str) -> list[Column]:
    fs, path = storage.arrow_filesystem(uri)
    with fs.open_input_file(path) as handle:
        return arrow_columns(pq.read_schema(handle))


def _parquet(uri: str) -> Written:
    fs, path = storage.arrow_filesystem(uri)
    with fs.open_input_file(path) as handle:
        metadata = pq.read_metadata(handle)
        size = handle.size()
    return Written(
        columns=arrow_columns(metadata.schema.to_arrow_schema()), rows=metadata.num_rows, bytes=size, files=1
    )


def _total_size(uris: list[str]) -> int | None:
    if not uris:
        return 0
    fs, _ = storage.arrow_filesystem(uris[0])
    infos = fs.get_file_info([storage.arrow_filesystem(u)[1] for u in uris])
    sizes = [info.size for info in infos]
    return None if None in sizes else sum(int(s) for s in sizes if s is not None)


def _json_type(value: Any) -> tuple[str, list[Column]]:
    if isinstance(value, dict):
        return "object", _json_columns(value)
    if isinstance(value, list):
        first = value[0] if value else None
        inner, fields = _json_type(first) if first is not None else ("null", [])
        return f"array<{inner}>", fields
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, kind):
            return name, []
    return "null", []


def _json_columns(document: dict[str, Any]) -> list[Column]:
    columns = []
    for key, value in document.items():
        kind, fields = _json_type(value)
        columns.append(Column(name=key, type=kind, fields=fields))
    return columns


def _json(uri: str) -> Written:
    """A JSON document: a list of records is rows of the first record's fields, an object one row of its keys."""
    body = storage.read_bytes(uri)
    document = json.loads(body)
    if isinstance(document, list):
        first = document[0] if document and isinstance(document[0], dict) else {}
        return Written(columns=_json_columns(first), rows=len(document), bytes=len(body), files=1)
    columns = _json_columns(document) if isinstance(document, dict) else []
    return Written(columns=columns, rows=1, bytes=len(body), files=1)


def _csv(uri: str) -> Written:
    body = storage.read_bytes(uri)
    table = pacsv.read_csv(io.BytesIO(body))
    return Written(columns=arrow_columns(table.schema), rows=table.num_rows, bytes=len(body), files=1)


def _folder(uri: str) -> Written:
    """A folder of files: its entries one level down, each a file (by suffix) or a folder of files."""
    objects = storage.list_objects(uri)
    entries: dict[str, str] = {}
    for obj in objects:
        top, _, rest = obj.key.partition("/")
        entries.setdefault(top, "folder" if rest else f"file:{posixpath.splitext(top)[1].lstrip('.') or 'bytes'}")
    columns = [Column(name=name, type=kind) for name, kind in sorted(entries.items())]
    return Written(columns=columns, **_sizes(objects))


def _sizes(objects: list[storage.ObjectInfo]) -> dict[str, int]:
    return {"bytes": sum(o.size for o in objects), "files": len(objects)}


_READERS: dict[str, Callable[[str], Written]] = {
    "manifest": _manifest,
    "parquet": _parquet,
    "json": _json,
    "csv": _csv,
    "folder": _folder,
    "model": _model,
    "alias": _alias,
}
