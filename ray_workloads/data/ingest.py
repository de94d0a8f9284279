"""Ingest: many small objects under a prefix → Parquet shards + manifest.

Per-object latency dominates with thousands of small objects, so each Ray task reads its slice of the
listing concurrently (``fetching.fetch_many``). An object that cannot be read for good (missing, replaced
since the listing) becomes a row with ``error_type`` set; reads that keep failing transiently fail the job
as transient, and a refused read as ``StorageAccessDenied``, so a cached dataset never holds a transient
error or a row that only says this run's policy refused it. Listed objects that are no inputs (hidden or
underscore names, folder markers) get no row: the manifest counts them per reason (``skipped``).

The listing is streamed into Parquet parts and shards are cut from them a part at a time: no process holds
the whole listing. The output folder is named by the input's identity (source URI + the listing's content
hash), so unchanged input maps to the same folder and a committed one (``manifest.json`` written last) is
reused. A run fills the folder only while it holds its lease (:mod:`rayline.storage.folders`): a concurrent
run on the same input waits, then reuses what the first committed.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from pydantic import BaseModel, Field

from rayline import lineage, progress, ray_work, storage
from rayline.errors import InputDataError, StorageError
from rayline.lineage import DatasetRef
from rayline.skipped import skipped_text
from rayline.storage import ObjectInfo, fetching, folders, leases, manifests
from rayline.storage.digests import SetDigest, item_hash
from rayline.storage.layout import STAGING_DIR
from rayline.storage.listing import (
    LISTING_VERSION,
    ROWS_PER_PART,
    StreamedListing,
    content_digest,
    iter_objects,
    list_to_parts,
)
from rayline.storage.listing import content_hash as listing_hash
from rayline.storage.manifests import MANIFEST as MANIFEST  # the ingest folder's manifest, named with the stage
from rayline.storage.manifests import IngestManifest, ShardInfo

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
    listing_part_objects: int = Field(ROWS_PER_PART, ge=1, description="Objects per Parquet part of the listing.")


class IngestResult(BaseModel):
    """Small, typed summary passed between stages: counts, the content hash and the manifest's URI, never the
    data nor the list of shards (:meth:`read_shards` reads it from the manifest), so its size does not grow."""

    source_uri: str
    output_uri: str
    manifest_uri: str
    content_hash: str
    object_count: int
    total_bytes: int
    fetch_errors: int
    labels: dict[str, int]
    shard_count: int = Field(description="The Parquet shards the manifest commits (read_shards lists them).")
    skipped: dict[str, int] = Field(default_factory=dict, description="Listed objects that are no inputs, by reason.")
    skipped_examples: dict[str, list[str]] = Field(default_factory=dict, description="The first keys of each reason.")
    cached: bool = False
    committed_by: str | None = Field(None, description="The lease holder (a flow run) whose run committed it.")
    waited_s: float = Field(0.0, description="How long this run waited for another run filling the same folder.")
    elapsed_s: float = 0.0

    def read_shards(self) -> list[ShardInfo]:
        """The shards, in order, as the manifest committed at ``manifest_uri`` now lists them (I/O): a forced
        run since may have committed another generation of the same objects in its place."""
        return manifests.read(self.manifest_uri, IngestManifest).shards

    def read_shard_uris(self) -> list[str]:
        """The shards' URIs, in order: reads the manifest (I/O, :meth:`read_shards`)."""
        return [s.uri for s in self.read_shards()]

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
        """The manifest that commits the shards, pinned to the same version; how many (the manifest lists them)."""
        return [
            DatasetRef(
                uri=self.manifest_uri,
                content_hash=self.content_hash,
                facets={"shard_count": self.shard_count},
                stored_as="manifest",
            )
        ]


def content_hash(objects: Iterable[ObjectInfo]) -> str:
    """The identity of an input version: :func:`rayline.storage.listing.content_hash` of its (key, etag) pairs,
    the same as a streamed listing's (:attr:`StreamedListing.content_hash`), whatever the order."""
    return listing_hash(SetDigest.of(content_digest(o.key, o.etag) for o in objects))


def label_from_key(key: str) -> str | None:
    """``<label>/<id>.png`` → ``label``; objects directly under the prefix have none."""
    parent = posixpath.dirname(key)
    return posixpath.basename(parent) or None


def objects_per_shard(count: int, cfg: IngestConfig) -> int:
    """Objects per shard for an input of ``count``: at most ``shard_max_objects``, at least ``min_shards`` shards."""
    wanted = max(cfg.min_shards, math.ceil(count / cfg.shard_max_objects))
    return max(1, min(cfg.shard_max_objects, math.ceil(count / wanted)))


def cut_shards(objects: Iterable[ObjectInfo], per_shard: int, max_bytes: int) -> Iterator[list[ObjectInfo]]:
    """Contiguous shards: each at most ``per_shard`` objects and ``max_bytes`` (a bigger object alone)."""
    current: list[ObjectInfo] = []
    current_bytes = 0
    for obj in objects:
        if current and (len(current) >= per_shard or current_bytes + obj.size > max_bytes):
            yield current
            current, current_bytes = [], 0
        current.append(obj)
        current_bytes += obj.size
    if current:
        yield current


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
    # a replaced object reads as ObjectChangedError: an error row
    listed = [fetching.as_listed(f, o.etag) for o, f in zip(objects, fetched, strict=True)]
    table = pack_shard(objects, [(f.data or b"") if f.error is None else f.error for f in listed])
    size = storage.write_parquet_atomic(shard_uri, table)
    failed = table.num_rows - table.column("error_type").null_count
    labels = Counter(label for label in table.column("label").to_pylist() if label is not None)
    return {"uri": shard_uri, "rows": table.num_rows, "bytes": size, "fetch_errors": failed, "labels": labels}


def dataset_id(source_uri: str, digest: str) -> str:
    return hashlib.sha256(f"{source_uri}\n{digest}".encode()).hexdigest()[:16]


def _result_from_manifest(
    manifest: IngestManifest, manifest_uri: str, cached: bool, elapsed: float, waited: float = 0.0
) -> IngestResult:
    return IngestResult(
        **manifest.model_dump(include=set(IngestResult.model_fields)),  # what it counts, from where, by whom
        output_uri=posixpath.dirname(manifest_uri),
        manifest_uri=manifest_uri,
        shard_count=len(manifest.shards),
        cached=cached,
        waited_s=waited,
        elapsed_s=elapsed,
    )


def read_manifest(manifest_uri: str) -> IngestResult:
    """Load a committed ingest manifest as a result."""
    manifest = manifests.read(manifest_uri, IngestManifest)
    return _result_from_manifest(manifest, manifest_uri, cached=True, elapsed=0.0)


def run(cfg: IngestConfig) -> IngestResult:
    """List (streamed, in parts), fetch concurrently on Ray, pack into shards, then commit the manifest."""
    started = time.perf_counter()
    source = storage.normalize(cfg.source_uri)
    # this run's listing parts; the run removes them (a killed run's are left under the hidden _staging)
    staging = storage.join(storage.normalize(cfg.output_root), STAGING_DIR, "listings", uuid.uuid4().hex)
    try:
        listing = list_to_parts(source, staging, rows_per_part=cfg.listing_part_objects)
        if listing.count == 0:
            left_out = f"; skipped {skipped_text(listing.skipped)}" if listing.skipped else ""
            raise InputDataError(f"no objects found under {source}{left_out}")
        digest = listing.content_hash
        output = storage.join(storage.normalize(cfg.output_root), dataset_id(source, digest))

        def fill(lease: leases.HeldLease, files: str) -> IngestManifest:
            return _fetch(cfg, listing, source, digest, files, lease)

        done = folders.fill_once(
            output,
            cfg,
            f"the ingest folder {posixpath.basename(output)}",
            IngestManifest,
            reusable=lambda manifest: manifest.content_hash == digest,
            force=cfg.force,
            fill=fill,
        )
    finally:
        storage.remove_tree(staging)
    result = _result_from_manifest(done.manifest, done.uri, done.cached, time.perf_counter() - started, done.waited_s)
    if not done.cached:
        return result
    # the inputs are the same; what this listing left out may not be (a new _SUCCESS)
    return result.model_copy(update={"skipped": listing.skipped, "skipped_examples": listing.skipped_examples})


# Shard tasks submitted and not yet done: bounds what the driver and the object store hold of the listing.
MAX_SHARDS_IN_FLIGHT = 64


def _fetch(
    cfg: IngestConfig, listing: StreamedListing, source: str, digest: str, files: str, lease: leases.HeldLease
) -> IngestManifest:
    """Fetch every listed object into shards under ``files``; the manifest that commits them (written after).
    One listing part is in memory at a time, and at most :data:`MAX_SHARDS_IN_FLIGHT` shard tasks wait."""
    per_shard = objects_per_shard(listing.count, cfg)
    fetch = _fetch_and_write_shard.options(num_cpus=cfg.num_cpus_per_task)
    stats: list[dict[str, Any]] = []
    in_flight: list[Any] = []
    with progress.stage("ingest", total=listing.count, unit="objects") as shown:

        def land(ready: list[Any]) -> None:
            for landed in ray_work.gather(ready):
                shown.add(landed["rows"])
                stats.append(landed)

        for chunk in cut_shards(iter_objects(listing), per_shard, cfg.shard_max_bytes):
            uri = storage.join(files, "shards", f"part-{len(stats) + len(in_flight):05d}.parquet")
            ray_work.raise_if_stopped()
            submitted = fetch.remote(chunk, uri, cfg.io_concurrency)
            # tracked at once: a timed-out attempt cancels what it started before a retry clears the folder
            ray_work.track([submitted])
            in_flight.append(submitted)
            if len(in_flight) >= MAX_SHARDS_IN_FLIGHT:
                ready, in_flight = ray.wait(in_flight, num_returns=1)
                land(ready)
        land(in_flight)
    stats.sort(key=lambda s: str(s["uri"]))
    rows = sum(s["rows"] for s in stats)
    if rows != listing.count:
        raise StorageError(f"ingest wrote {rows} rows for {listing.count} objects under {source}")
    labels = sum((Counter(s["labels"]) for s in stats), Counter[str]())
    return IngestManifest(
        source_uri=source,
        content_hash=digest,
        listing_version=LISTING_VERSION,
        object_count=listing.count,
        total_bytes=listing.bytes,
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
    latest = max(earlier, key=lambda r: r.ended_at, default=None)
    return None if latest is None else read_manifest(latest.outputs[0].uri)


def _pair_hashes(keys: list[str], etags: list[str]) -> np.ndarray:
    """A 64-bit hash of each (key, etag): what arrivals compare, 8 bytes an object instead of a set of strings."""
    mask = (1 << 64) - 1
    return np.array([item_hash(content_digest(k, e)) & mask for k, e in zip(keys, etags, strict=True)], dtype=np.uint64)


def arrivals(current: IngestResult, previous: IngestResult | None) -> Arrivals:
    """What changed between two ingests of one source, by (key, etag), one shard in memory at a time.

    The previous ingest is held as 64-bit hashes (8 bytes an object): a new object whose hash equals an old
    one's (chance about n·2^-64) is taken for old.
    """
    columns = ["key", "etag", "label"]
    before = np.zeros(0, dtype=np.uint64)
    if previous is not None:
        parts = []
        for uri in previous.read_shard_uris():
            old = storage.read_parquet([uri], columns=["key", "etag"])
            parts.append(_pair_hashes(old.column("key").to_pylist(), old.column("etag").to_pylist()))
        before = np.sort(np.concatenate(parts)) if parts else before
    labels: Counter[str] = Counter()
    new = 0
    for uri in current.read_shard_uris():
        now = storage.read_parquet([uri], columns=columns)
        keys, etags, names = (now.column(c).to_pylist() for c in columns)
        fresh = ~np.isin(_pair_hashes(keys, etags), before, assume_unique=False)
        new += int(fresh.sum())
        labels.update(label for label, is_new in zip(names, fresh, strict=True) if is_new and label is not None)
    return Arrivals(
        source_uri=current.source_uri,
        new_objects=new,
        new_labelled=sum(labels.values()),
        labels=dict(sorted(labels.items())),
    )
