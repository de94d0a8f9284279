"""Ingest: many small objects under a prefix → Parquet shards + manifest.

Per-object latency dominates when reading thousands of small objects, so
each Ray task fetches its slice of the listing with many concurrent reads
(``fetching.fetch_many``), not one GET after another. An object that cannot
be read for good (missing, forbidden, replaced since the listing) becomes a
row with ``error_type`` set, never a failed job; one whose reads keep failing
transiently (throttling, 5xx, resets, after ``fetch_many``'s rounds of
retries) fails the job as transient and nothing is committed: a cached
dataset never holds a transient error. Listed objects that are no inputs
(hidden or underscore names, folder markers) get no row: the manifest counts
them per reason (``skipped``).

The output folder is named by the input's identity (source URI + content hash
of the sorted ``(key, etag)`` list): unchanged input maps to the same folder,
and a committed folder (``manifest.json`` written last,
:class:`rayline.manifests.IngestManifest`) is reused as is. A run fills the
folder only while it holds the folder's lease (:mod:`rayline.folders`): a
concurrent run on the same input waits, then reuses what the first committed.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import ray
from pydantic import BaseModel, Field

from rayline import fetching, folders, leases, lineage, manifests, progress, storage
from rayline.errors import InputDataError, RaylineError, StorageError
from rayline.lineage import DatasetRef
from rayline.manifests import MANIFEST as MANIFEST  # where tests and callers have always found it
from rayline.manifests import IngestManifest, ShardInfo
from rayline.skipped import skipped_text
from rayline.storage import ObjectInfo

SHARD_SCHEMA = pa.schema(
    [
        ("uri", pa.string()),
        ("key", pa.string()),
        ("etag", pa.string()),
        ("size", pa.int64()),
        ("label", pa.string()),
        ("data", pa.binary()),
        ("error_type", pa.string()),
        ("error_message", pa.string()),
    ]
)


class IngestConfig(folders.LeasedOutput):
    """What to ingest, where to, and the compute shape of the job."""

    source_uri: str
    output_root: str
    shard_max_objects: int = Field(512, ge=1)
    shard_max_bytes: int = Field(64 * 2**20, ge=1)
    min_shards: int = Field(4, ge=1, description="Split small inputs so several tasks fetch at once.")
    io_concurrency: int = Field(64, ge=1, le=1024)
    num_cpus_per_task: float = Field(0.25, gt=0)
    force: bool = Field(False, description="Rewrite even if this input was already ingested.")


class IngestResult(BaseModel):
    """Small, typed summary passed between stages (never the data itself)."""

    source_uri: str
    output_uri: str
    manifest_uri: str
    content_hash: str
    object_count: int
    total_bytes: int
    fetch_errors: int
    labels: dict[str, int]
    shards: list[ShardInfo]
    skipped: dict[str, int] = Field(default_factory=dict, description="Listed objects that are no inputs, by reason.")
    skipped_examples: dict[str, list[str]] = Field(default_factory=dict, description="The first keys of each reason.")
    cached: bool = False
    committed_by: str | None = Field(None, description="The lease holder (a flow run) whose run committed it.")
    waited_s: float = Field(0.0, description="How long this run waited for another run filling the same folder.")
    elapsed_s: float = 0.0

    @property
    def shard_uris(self) -> list[str]:
        return [s.uri for s in self.shards]

    def lineage_inputs(self) -> list[DatasetRef]:
        """The listed objects, as one version (the hash of their keys and etags)."""
        counts: dict[str, Any] = {"object_count": self.object_count, "total_bytes": self.total_bytes}
        return [
            DatasetRef(
                uri=self.source_uri,
                content_hash=self.content_hash,
                facets=counts | ({"skipped": self.skipped} if self.skipped else {}),
            )
        ]

    def lineage_outputs(self) -> list[DatasetRef]:
        """The manifest that commits the shards, pinned to the same version."""
        return [DatasetRef(uri=self.manifest_uri, content_hash=self.content_hash, facets={"shards": self.shard_uris})]


def content_hash(objects: Sequence[ObjectInfo]) -> str:
    """sha256 of the sorted (key, etag) list: the identity of an input version."""
    digest = hashlib.sha256()
    for obj in sorted(objects, key=lambda o: o.key):
        digest.update(f"{obj.key}\t{obj.etag}\n".encode())
    return digest.hexdigest()


def label_from_key(key: str) -> str | None:
    """``<label>/<id>.png`` → ``label``; objects directly under the prefix have none."""
    parent = posixpath.dirname(key)
    return posixpath.basename(parent) or None


def plan_shards(objects: Sequence[ObjectInfo], cfg: IngestConfig) -> list[list[ObjectInfo]]:
    """Cut the listing into contiguous shards bounded by object count and bytes."""
    wanted = max(cfg.min_shards, math.ceil(len(objects) / cfg.shard_max_objects))
    per_shard = max(1, min(cfg.shard_max_objects, math.ceil(len(objects) / wanted)))
    shards: list[list[ObjectInfo]] = []
    current: list[ObjectInfo] = []
    current_bytes = 0
    for obj in objects:
        if current and (len(current) >= per_shard or current_bytes + obj.size > cfg.shard_max_bytes):
            shards.append(current)
            current, current_bytes = [], 0
        current.append(obj)
        current_bytes += obj.size
    if current:
        shards.append(current)
    return shards


class ObjectChangedError(Exception):
    """The object was replaced between listing and reading; the next run picks it up."""


def _as_payload(obj: ObjectInfo, fetched: fetching.Fetched) -> bytes | BaseException:
    if fetched.error is not None:
        return fetched.error
    if fetched.etag is not None and fetched.etag != obj.etag:
        return ObjectChangedError(f"etag changed from {obj.etag} to {fetched.etag} while ingesting")
    return fetched.data or b""


def pack_shard(objects: Sequence[ObjectInfo], payloads: Sequence[bytes | BaseException]) -> pa.Table:
    """One row per object: bytes on success, error type and message otherwise."""
    columns: dict[str, list[Any]] = {name: [] for name in SHARD_SCHEMA.names}
    for obj, payload in zip(objects, payloads, strict=True):
        failed = isinstance(payload, BaseException)
        columns["uri"].append(obj.uri)
        columns["key"].append(obj.key)
        columns["etag"].append(obj.etag)
        columns["size"].append(obj.size)
        columns["label"].append(label_from_key(obj.key))
        columns["data"].append(None if failed else payload)
        columns["error_type"].append(type(payload).__name__ if failed else None)
        columns["error_message"].append(str(payload)[:500] if failed else None)
    return pa.table(columns, schema=SHARD_SCHEMA)


@ray.remote(max_retries=3, retry_exceptions=False)
def _fetch_and_write_shard(objects: list[ObjectInfo], shard_uri: str, concurrency: int) -> dict[str, Any]:
    fetched = fetching.fetch_many([o.uri for o in objects], concurrency)
    table = pack_shard(objects, [_as_payload(o, f) for o, f in zip(objects, fetched, strict=True)])
    size = storage.write_parquet_atomic(shard_uri, table)
    fetched_ok = table.column("error_type").null_count
    labels = Counter(label for label in table.column("label").to_pylist() if label is not None)
    return {
        "uri": shard_uri,
        "rows": table.num_rows,
        "bytes": size,
        "fetch_errors": table.num_rows - fetched_ok,
        "labels": labels,
    }


def dataset_id(source_uri: str, digest: str) -> str:
    return hashlib.sha256(f"{source_uri}\n{digest}".encode()).hexdigest()[:16]


def _result_from_manifest(
    manifest: IngestManifest, manifest_uri: str, cached: bool, elapsed: float, waited: float = 0.0
) -> IngestResult:
    return IngestResult(
        source_uri=manifest.source_uri,
        output_uri=posixpath.dirname(manifest_uri),
        manifest_uri=manifest_uri,
        content_hash=manifest.content_hash,
        object_count=manifest.object_count,
        total_bytes=manifest.total_bytes,
        fetch_errors=manifest.fetch_errors,
        labels=manifest.labels,
        shards=manifest.shards,
        skipped=manifest.skipped,
        skipped_examples=manifest.skipped_examples,
        committed_by=manifest.committed_by,
        cached=cached,
        waited_s=waited,
        elapsed_s=elapsed,
    )


def read_manifest(manifest_uri: str) -> IngestResult:
    """Load a committed ingest manifest as a result."""
    manifest = manifests.read(manifest_uri, IngestManifest)
    return _result_from_manifest(manifest, manifest_uri, cached=True, elapsed=0.0)


def run(cfg: IngestConfig) -> IngestResult:
    """List, fetch concurrently on Ray, pack into shards, then commit the manifest."""
    started = time.perf_counter()
    source = storage.normalize(cfg.source_uri)
    listing = storage.list_inputs(source)
    objects = listing.objects
    if not objects:
        left_out = f"; skipped {skipped_text(listing.skipped)}" if listing.skipped else ""
        raise InputDataError(f"no objects found under {source}{left_out}")
    digest = content_hash(objects)
    output = storage.join(storage.normalize(cfg.output_root), dataset_id(source, digest))
    done = folders.fill_once(
        output,
        cfg,
        f"the ingest folder {posixpath.basename(output)}",
        IngestManifest,
        reusable=lambda manifest: manifest.content_hash == digest,
        force=cfg.force,
        fill=lambda lease: _fetch(cfg, listing, source, digest, output, lease),
    )
    result = _result_from_manifest(done.manifest, done.uri, done.cached, time.perf_counter() - started, done.waited_s)
    if not done.cached:
        return result
    # the inputs are the same; what this listing left out may not be (a new _SUCCESS)
    return result.model_copy(update={"skipped": listing.skipped, "skipped_examples": listing.skipped_examples})


def _gather(refs: list[Any], shown: progress.Stage) -> list[dict[str, Any]]:
    """``ray.get(refs)`` in order, counting each shard's objects as it lands.

    A rayline error raised in a task comes out as itself: a transient fetch stays transient.
    """
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            shown.add(sum(s["rows"] for s in ray.get(ready)))
        return list(ray.get(refs))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, RaylineError):
            raise exc.cause from exc
        raise


def _fetch(
    cfg: IngestConfig, listing: storage.Listing, source: str, digest: str, output: str, lease: leases.HeldLease
) -> IngestManifest:
    """Fetch every listed object into ``output``'s shards; the manifest that commits them (written after)."""
    objects = listing.objects
    shards = plan_shards(objects, cfg)
    fetch = _fetch_and_write_shard.options(num_cpus=cfg.num_cpus_per_task)
    refs = [
        fetch.remote(chunk, storage.join(output, "shards", f"part-{i:05d}.parquet"), cfg.io_concurrency)
        for i, chunk in enumerate(shards)
    ]
    with progress.stage("ingest", total=len(objects), unit="objects") as shown:
        stats = _gather(refs, shown)
    rows = sum(s["rows"] for s in stats)
    if rows != len(objects):
        raise StorageError(f"ingest wrote {rows} rows for {len(objects)} objects under {source}")

    labels: Counter[str] = Counter()
    for s in stats:
        labels.update(s["labels"])
    return IngestManifest(
        source_uri=source,
        content_hash=digest,
        object_count=len(objects),
        total_bytes=sum(o.size for o in objects),
        fetch_errors=sum(s["fetch_errors"] for s in stats),
        labels=dict(sorted(labels.items())),
        shards=[ShardInfo.model_validate(s) for s in stats],  # a shard's labels count in the sum above only
        skipped=listing.skipped,
        skipped_examples=listing.skipped_examples,
        committed_by=lease.lease.holder,  # a retried task can tell its own commit from an older run's
    )


class Arrivals(BaseModel):
    """Objects of an ingest that the previous ingest of the same source did not have (or had another etag)."""

    source_uri: str
    new_objects: int
    new_labelled: int
    labels: dict[str, int]


def arrivals_since_previous(current: IngestResult) -> Arrivals:
    """What ``current`` holds that the previous ingest of its source (another version) did not."""
    return arrivals(current, previous_ingest(current))


def previous_ingest(current: IngestResult) -> IngestResult | None:
    """The latest earlier ingest of the same source with other content, from the ingest stage's lineage records."""
    earlier = [
        r
        for r in lineage.read_records("ingest")
        if r.inputs and r.inputs[0].uri == current.source_uri and r.outputs[0].content_hash != current.content_hash
    ]
    if not earlier:
        return None
    latest = max(earlier, key=lambda r: r.ended_at)
    return read_manifest(latest.outputs[0].uri)


def arrivals(current: IngestResult, previous: IngestResult | None) -> Arrivals:
    """What changed between two ingests of one source, by (key, etag)."""
    columns = ["key", "etag", "label"]
    before = set()
    if previous is not None:
        old = storage.read_parquet(previous.shard_uris, columns=columns)
        before = set(zip(old.column("key").to_pylist(), old.column("etag").to_pylist(), strict=True))
    now = storage.read_parquet(current.shard_uris, columns=columns)
    labels: Counter[str] = Counter()
    new = 0
    for key, etag, label in zip(*(now.column(c).to_pylist() for c in columns), strict=True):
        if (key, etag) not in before:
            new += 1
            if label is not None:
                labels[label] += 1
    return Arrivals(
        source_uri=current.source_uri,
        new_objects=new,
        new_labelled=sum(labels.values()),
        labels=dict(sorted(labels.items())),
    )
