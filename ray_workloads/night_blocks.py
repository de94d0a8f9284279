"""The blocks of a night: cut from the listing's parts in Ray tasks, written once each, found again by a rerun.

A block is ``objects_per_task`` consecutive rows of one listing part
(:mod:`rayline.storage.listing`), named ``<part>/b<first row>``. Blocks are cut by a
Ray Data ``flat_map`` over the parts, so the driver never holds a list of
them, and each goes to a predictor actor, which writes it as two Parquet files
at names fixed by the night's *key* and the block's name
(:func:`block_file_uri`)::

    <table>/model_name=<m>/dt=<d>/blocks-<key>/<part>/b<first row>.parquet

in both tables, the errors file first and then the predictions file, whose
footer holds the block's report (:class:`BlockReport`: rows of each kind, the
digest of the block's URIs, the error types). Each attempt writes both files,
even empty ones, and a retry overwrites them, so a block never has a stale
file of an earlier attempt beside it.

The key (:func:`night_key`) is a hash of what decides a block's rows: the
night, the model version and its weights, the listing's content hash, the
block size, ``top_k`` and the code version. A rerun of the same night with the
same model over the same listing has the same key, so it finds the blocks a
killed attempt wrote: a block whose predictions file exists and whose report
names the same URIs (same digest) is reused, not predicted again
(:class:`PartBlocks`). Block files are never committed; the night's compacted
files are (:mod:`ray_workloads.night_compaction`), and vacuum deletes block
files as files no version references, once past the retention.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayline import storage
from rayline.storage import leases
from rayline.storage.digests import SetDigest
from rayline.storage.folders import LeasedOutput
from rayline.storage.layout import staging_uri
from rayline.storage.listing import read_part
from rayline.tables.delta_tables import Night

# Columns of the rows the predictor actors take (one row per block) and of the reports they return.
BLOCK_COLUMNS = ("block", "uris", "etags", "reused")
REPORT_COLUMNS = (
    *("block", "predictions", "errors", "predictions_bytes", "errors_bytes", "uris", "error_types", "reused"),
)
_REPORT_KEY = b"rayline.block"


def night_key(parts: dict[str, Any]) -> str:
    """``k`` and 16 hex digits: the same for every run that would write the same blocks."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return "k" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NightOutput:
    """Where a run's actors write: the two tables' URIs, the night, the key of its blocks, and its run id."""

    predictions_table: str
    errors_table: str
    night: Night
    run_id: str
    key: str


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

    @property
    def part(self) -> str:
        return self.block.partition("/")[0]

    def to_json(self) -> str:
        return json.dumps(self.row(), sort_keys=True)

    def row(self) -> dict[str, Any]:
        return {
            "block": self.block,
            "predictions": self.predictions,
            "errors": self.errors,
            "predictions_bytes": self.predictions_bytes,
            "errors_bytes": self.errors_bytes,
            "uris": self.uris.encode(),
            "error_types": json.dumps(self.error_types, sort_keys=True),
            "reused": self.reused,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> BlockReport:
        types = row["error_types"]
        return cls(
            block=str(row["block"]),
            predictions=int(row["predictions"]),
            errors=int(row["errors"]),
            predictions_bytes=int(row["predictions_bytes"]),
            errors_bytes=int(row["errors_bytes"]),
            uris=SetDigest.decode(str(row["uris"])),
            error_types=json.loads(types) if isinstance(types, str) else dict(types),
            reused=bool(row.get("reused", False)),
        )


def reports_batch(reports: list[BlockReport]) -> dict[str, np.ndarray]:
    """Block reports as a (tiny) output batch of the predictor UDF."""
    rows = [r.row() for r in reports]
    return {name: np.array([row[name] for row in rows], dtype=object) for name in REPORT_COLUMNS}


def _write_parquet(uri: str, table: pa.Table, report: BlockReport | None = None) -> int:
    if report is not None:
        table = table.replace_schema_metadata({_REPORT_KEY: report.to_json().encode()})
    # not fsynced: a block torn by a machine crash reads as unwritten (written_report) and is predicted again
    return storage.write_parquet_atomic(uri, table, durable=False)


def write_block_files(
    output: NightOutput, block: str, predictions: pa.Table, errors: pa.Table, error_types: dict[str, int]
) -> BlockReport:
    """Write a block's two files, errors first: the predictions file, with the report in its footer, marks it done."""
    uris = SetDigest.of(predictions.column("uri").to_pylist()) + SetDigest.of(errors.column("uri").to_pylist())
    errors_bytes = _write_parquet(block_file_uri(output.errors_table, output.night, output.key, block), errors)
    # the report's own size is not known before writing it: the footer holds the errors file's, the driver both
    report = BlockReport(block, predictions.num_rows, errors.num_rows, 0, errors_bytes, uris, error_types)
    uri = block_file_uri(output.predictions_table, output.night, output.key, block)
    predictions_bytes = _write_parquet(uri, predictions, report)
    return BlockReport(block, predictions.num_rows, errors.num_rows, predictions_bytes, errors_bytes, uris, error_types)


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
    return BlockReport(
        block, stored.predictions, stored.errors, int(info.size), stored.errors_bytes, stored.uris, stored.error_types
    )


def cut_part(row: dict[str, Any], *, output: NightOutput, size: int, resuming: bool) -> list[dict[str, Any]]:
    """The ``flat_map`` over listing parts: one part's rows cut into blocks, each marked reused or to predict.

    Without an earlier attempt under the night's key (``resuming=False``) no
    block file is looked for. Otherwise a block is reused when its
    predictions file exists and its report's digest is that of the block's
    URIs now: an earlier attempt wrote exactly these rows.
    """
    table = read_part(str(row["part"]))
    uris, etags = table.column("uri").to_pylist(), table.column("etag").to_pylist()
    blocks = []
    for start in range(0, len(uris), size):
        name = block_name(str(row["name"]), start)
        chunk = uris[start : start + size]
        previous = written_report(output, name) if resuming else None
        if previous is not None and previous.uris == SetDigest.of(chunk):
            blocks.append({"block": name, "uris": [], "etags": [], "reused": previous.to_json()})
        else:
            blocks.append({"block": name, "uris": chunk, "etags": etags[start : start + size], "reused": ""})
    return blocks


def any_block_written(output: NightOutput) -> bool:
    """Whether any attempt under the night's key wrote a block (then a rerun looks for each one)."""
    return bool(storage.list_folders(blocks_root(output.predictions_table, output.night, output.key)))


def listing_staging_uri(root: str, night: Night) -> str:
    """``<root>/_staging/nights/<model>/dt=<day>/listing``: the night's listing parts, written by the lease's holder."""
    return staging_uri(root, "nights", night.model_name, f"dt={night.dt}", "listing")


def night_lease_uri(root: str, night: Night) -> str:
    """``<root>/_staging/nights/<model>/dt=<day>.lease``: the lease of one night."""
    return staging_uri(root, "nights", night.model_name, f"dt={night.dt}.lease")


@contextmanager
def held_night(root: str, night: Night, cfg: LeasedOutput) -> Iterator[leases.HeldLease]:
    """The night's lease: one live run predicts a night; the others wait, then find it committed or take over.

    A holder that died stops renewing: its lease expires after ``lease_ttl_s``
    and the next run takes it, and with it the blocks the dead run wrote
    (same night key).
    """
    holder = cfg.holder or leases.run_holder()
    describe = f"the night {night.model_name} {night.dt}"
    uri = night_lease_uri(root, night)
    with leases.held(uri, holder, ttl_s=cfg.lease_ttl_s, wait_s=cfg.lease_wait_s, describe=describe) as lease:
        yield lease
