"""The blocks of a night: spans of them cut from the listing's parts, written once each, found again by a rerun.

A block is ``objects_per_task`` consecutive rows of one listing part; :func:`cut_part` cuts parts into
spans of blocks by arithmetic alone, an actor writes each block's two files at names fixed by the
night's key (:func:`night_key`, :func:`block_file_uri`), and a rerun reuses a block whose report names
the same URIs at the same ETags (:func:`reused_report`). Why spans, and what the key holds:
docs/nights.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayline import storage
from rayline.ray_workloads.quality.shadow import ShadowCounts, block_counts
from rayline.storage.digests import SetDigest
from rayline.storage.listing import ListingStart, decode_prefixes, list_group_parts
from rayline.tables.delta_tables import Night

# Columns of the rows the predictor actors take (one row per span of blocks) and of the reports they return.
SPAN_COLUMNS = ("part", "name", "start", "stop", "size", "resuming")
# Blocks per span, at most: a span is what one actor call takes (this module's docstring).
SPAN_BLOCKS = 16
# Spans per actor a night has at least before its blocks are grouped: the pool's load stays balanced.
SPANS_PER_ACTOR = 16
# A predictor call returns one row, its blocks' reports as a JSON list (reports_batch): with the night's
# target_max_block_size of 1 each output row is a Ray Data block, and a row per block cost ~0.5 s a span.
REPORT_COLUMN = "reports"
CPU_COLUMN = "cpu_s"  # beside the reports: the actor's CPU seconds since its previous call (its set-up in the first)
_REPORT_KEY = b"rayline.block"


def night_key(parts: dict[str, Any]) -> str:
    """``k`` and 16 hex digits: the same for every run that would write the same blocks."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return "k" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NightOutput:
    """Where a run's actors write: the tables' URIs, the night, the key of its blocks, and its run id."""

    predictions_table: str
    errors_table: str
    night: Night
    run_id: str
    key: str
    shadow_table: str | None = None  # where a shadow version's rows go, on a night that scores one

    def tables(self) -> dict[str, str]:
        """Each kind of block file with its table: predictions, errors, and shadow on a shadowed night."""
        kinds = {"predictions": self.predictions_table, "errors": self.errors_table}
        return kinds if self.shadow_table is None else {**kinds, "shadow": self.shadow_table}


def block_name(part: str, start: int) -> str:
    return f"{part}/b{start:09d}"


def blocks_root(table: str, night: Night, key: str) -> str:
    """``<table>/model_name=<m>/dt=<d>/blocks-<key>``: every block file of one night key in one table."""
    return storage.join(storage.normalize(table), night.relative_dir, f"blocks-{key}")


def block_folder(table: str, night: Night, key: str, part: str) -> str:
    return storage.join(blocks_root(table, night, key), part)


def block_file_uri(table: str, night: Night, key: str, block: str) -> str:
    part, _, name = block.partition("/")
    return storage.join(block_folder(table, night, key, part), f"{name}.parquet")


@dataclass(frozen=True)
class BlockReport:
    """What a written block holds: rows per kind, file sizes, the digest of its URIs, error types."""

    block: str
    predictions: int
    errors: int
    predictions_bytes: int
    errors_bytes: int
    uris: SetDigest
    error_types: dict[str, int] = field(default_factory=dict)
    reused: bool = False
    # of "uri<TAB>etag" for the block's inputs: a rerun reuses the block only for the same objects' versions
    contents: SetDigest = SetDigest()
    # the record of the execution plan that predicted the block's rows (execution.plan.PlanChoice.record)
    plan: dict[str, Any] = field(default_factory=dict)
    shadow: int = 0  # the shadow version's rows, on a shadowed night
    shadow_bytes: int = 0
    shadow_counts: ShadowCounts | None = None  # its comparison with the block's predictions, on a shadowed night

    @property
    def part(self) -> str:
        return self.block.partition("/")[0]

    def to_json(self) -> str:
        return json.dumps(self.row(), sort_keys=True)

    def row(self) -> dict[str, Any]:
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "uris": self.uris.encode(),
            "error_types": json.dumps(self.error_types, sort_keys=True),
            "contents": self.contents.encode(),
            "plan": json.dumps(self.plan, sort_keys=True),
            "shadow_counts": self.shadow_counts.to_json() if self.shadow_counts is not None else "",
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> BlockReport:
        """A report as :meth:`row` wrote it (a JSON object); fields it lacks keep their defaults."""
        types, counts = row["error_types"], row.get("shadow_counts")
        decoded = {
            "uris": SetDigest.decode(str(row["uris"])),
            "error_types": json.loads(types) if isinstance(types, str) else dict(types),
            # a report without it (written before it was kept) matches no block: that block is predicted again
            "contents": SetDigest.decode(str(row["contents"])) if row.get("contents") else SetDigest(),
            "plan": json.loads(row["plan"]) if row.get("plan") else {},
            "shadow_counts": ShadowCounts.from_json(str(counts)) if counts else None,
        }
        return cls(**{**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row}, **decoded})


def reports_batch(reports: list[BlockReport], cpu_s: float = 0.0) -> dict[str, np.ndarray]:
    """Block reports as a (tiny) output batch of the predictor UDF: one row, the reports as a JSON list, and the
    CPU seconds the actor spent on them (not in the reports: a reused block's report is an earlier run's)."""
    return {
        REPORT_COLUMN: np.array([json.dumps([r.row() for r in reports], sort_keys=True)], dtype=object),
        CPU_COLUMN: np.array([cpu_s], dtype=np.float64),
    }


def objects_reported(batch: dict[str, np.ndarray]) -> int:
    """The objects (rows of either kind) that an output batch of the predictor UDF reports."""
    return sum(r.predictions + r.errors for text in batch[REPORT_COLUMN] for r in reports_of({REPORT_COLUMN: text}))


def reports_of(row: dict[str, Any]) -> list[BlockReport]:
    """The block reports of one output row of the predictor UDF (:func:`reports_batch`)."""
    return [BlockReport.from_row(report) for report in json.loads(str(row[REPORT_COLUMN]))]


def _write_parquet(uri: str, table: pa.Table, report: BlockReport | None = None) -> int:
    if report is not None:
        table = table.replace_schema_metadata({_REPORT_KEY: report.to_json().encode()})
    # not fsynced: a block torn by a machine crash reads as unwritten (written_report) and is predicted again
    return storage.write_parquet_atomic(uri, table, durable=False)


def block_contents(uris: list[str], etags: list[str]) -> SetDigest:
    """The digest of a block's inputs with their versions (``uri<TAB>etag`` each)."""
    return SetDigest.of(f"{uri}\t{etag}" for uri, etag in zip(uris, etags, strict=True))


def write_block_files(
    output: NightOutput,
    block: str,
    predictions: pa.Table,
    errors: pa.Table,
    error_types: dict[str, int],
    contents: SetDigest,
    plan: dict[str, Any] | None = None,
    shadow: pa.Table | None = None,
) -> BlockReport:
    """Write a block's files, errors (and shadow) first: the predictions file, with the report in its footer,
    marks it done. ``contents``: :func:`block_contents` of the block's inputs; ``plan``: the record of the plan
    that predicted; ``shadow``: the shadow version's rows, on a night whose output has a shadow table."""
    uris = SetDigest.of(predictions.column("uri").to_pylist()) + SetDigest.of(errors.column("uri").to_pylist())
    errors_bytes = _write_parquet(block_file_uri(output.errors_table, output.night, output.key, block), errors)
    shadow_rows, shadow_bytes, counts = 0, 0, None
    if output.shadow_table is not None:
        shadow = shadow if shadow is not None else predictions.schema.empty_table()
        shadow_rows, counts = shadow.num_rows, block_counts(predictions, shadow)
        shadow_bytes = _write_parquet(block_file_uri(output.shadow_table, output.night, output.key, block), shadow)
    # the report's own size is not known before writing it: the footer holds the errors file's, the driver both
    report = BlockReport(
        block,
        predictions.num_rows,
        errors.num_rows,
        0,
        errors_bytes,
        uris,
        error_types,
        contents=contents,
        plan=plan or {},
        shadow=shadow_rows,
        shadow_bytes=shadow_bytes,
        shadow_counts=counts,
    )
    uri = block_file_uri(output.predictions_table, output.night, output.key, block)
    predictions_bytes = _write_parquet(uri, predictions, report)
    return dataclasses.replace(report, predictions_bytes=predictions_bytes)


def written_report(output: NightOutput, block: str) -> BlockReport | None:
    """The report of a block an earlier attempt wrote under the same key, or None when it has none."""
    uri = block_file_uri(output.predictions_table, output.night, output.key, block)
    fs, path = storage.arrow_filesystem(uri)
    try:
        info = fs.get_file_info(path)
        if info.size is None:  # not there: never written, or written by no attempt that finished it
            return None
        metadata = pq.read_metadata(path, filesystem=fs).metadata or {}
    except pa.ArrowInvalid:
        return None  # torn (a machine crash before it reached the disk): predicted again
    except OSError as exc:
        raise storage.storage_error(exc, "reading the footer of", uri) from exc
    if _REPORT_KEY not in metadata:
        return None
    stored = BlockReport.from_row(json.loads(metadata[_REPORT_KEY]))
    # its model calls were an earlier attempt's: no plan use of this run's
    return dataclasses.replace(stored, block=block, predictions_bytes=int(info.size), reused=False, plan={})


def blocks_per_span(blocks: int, actors: int) -> int:
    """Blocks per span for a night of ``blocks`` blocks over ``actors`` actors: one for small nights, up to
    :data:`SPAN_BLOCKS` once the night has ``SPANS_PER_ACTOR`` spans an actor anyway (the tail stays short)."""
    return max(1, min(SPAN_BLOCKS, blocks // max(1, actors * SPANS_PER_ACTOR)))


@dataclass(frozen=True)
class Cutting:
    """What a night's block cutters need besides their row: the block size, blocks per span, whether an
    earlier attempt wrote blocks under the key, and where the listing's groups are listed to."""

    size: int
    per_span: int
    resuming: bool
    root: str  # the listed prefix
    staging: str  # where the listing's parts go
    rows_per_part: int


def cutter_rows(listing: ListingStart) -> list[dict[str, Any]]:
    """The rows a night's cutters take: each part the driver listed, then each group of sub-prefixes left."""
    parts = [{"part": p.uri, "name": p.name, "rows": p.rows, "prefixes": ""} for p in listing.own.parts]
    groups = [
        {"part": "", "name": name, "rows": 0, "prefixes": json.dumps(prefixes)} for name, prefixes in listing.groups
    ]
    return parts + groups


def cut_part(row: dict[str, Any], *, cutting: Cutting) -> Iterator[dict[str, Any]]:
    """The ``flat_map`` of a night's cutters: spans of ``cutting.per_span`` blocks of ``cutting.size`` rows.

    A row is a listing part the driver wrote (arithmetic on its row count: the actor reads the rows), or a
    group of sub-prefixes listed here, each part's spans yielded as it is written, so the first blocks are
    predicted while the rest is still listed (:func:`rayline.storage.listing.list_group_parts`).
    """
    if row["prefixes"]:
        prefixes = decode_prefixes(str(row["prefixes"]))
        parts = list_group_parts(cutting.root, prefixes, cutting.staging, str(row["name"]), cutting.rows_per_part)
        for part in parts:
            yield from _spans(part.uri, part.name, part.rows, cutting)
    else:
        yield from _spans(str(row["part"]), str(row["name"]), int(row["rows"]), cutting)


def _spans(part: str, name: str, rows: int, cutting: Cutting) -> Iterator[dict[str, Any]]:
    step = cutting.size * cutting.per_span
    for start in range(0, rows, step):
        span = (part, name, start, min(rows, start + step), cutting.size, cutting.resuming)
        yield dict(zip(SPAN_COLUMNS, span, strict=True))


class PartRows:
    """The URIs and ETags of listing parts, the last few read kept as Arrow columns (spans of two or three
    parts are cut at once and interleave; a block's slice becomes Python strings only when it is taken)."""

    KEPT = 4

    def __init__(self) -> None:
        self._parts: OrderedDict[str, tuple[pa.ChunkedArray, pa.ChunkedArray]] = OrderedDict()

    def _columns(self, uri: str) -> tuple[pa.ChunkedArray, pa.ChunkedArray]:
        if uri in self._parts:
            self._parts.move_to_end(uri)
        else:
            table = storage.read_parquet([uri], columns=["uri", "etag"])
            self._parts[uri] = (table.column("uri"), table.column("etag"))
            if len(self._parts) > self.KEPT:
                self._parts.popitem(last=False)
        return self._parts[uri]

    def blocks(self, span: dict[str, Any]) -> Iterator[tuple[str, list[str], list[str]]]:
        """(block name, URIs, ETags) of each block of ``span`` (a row of :func:`cut_part`)."""
        uris, etags = self._columns(str(span["part"]))
        size, stop = int(span["size"]), int(span["stop"])
        for start in range(int(span["start"]), stop, size):
            rows = min(stop, start + size) - start
            name = block_name(str(span["name"]), start)
            yield name, uris.slice(start, rows).to_pylist(), etags.slice(start, rows).to_pylist()


def reused_report(output: NightOutput, block: str, uris: list[str], etags: list[str]) -> BlockReport | None:
    """The report of ``block`` as an earlier attempt under the same key wrote it, if it wrote exactly these
    objects at these versions (the digests of its URIs, and of its URIs with their ETags)."""
    previous = written_report(output, block)
    if previous is None or previous.uris != SetDigest.of(uris) or previous.contents != block_contents(uris, etags):
        return None
    if output.shadow_table is not None and previous.shadow_counts is None:
        return None  # its shadow rows were never compared: predicted again
    return dataclasses.replace(previous, reused=True)


def any_block_written(output: NightOutput) -> bool:
    """Whether any attempt under the night's key wrote a block (then a rerun looks for each one)."""
    return bool(storage.list_folders(blocks_root(output.predictions_table, output.night, output.key)))
