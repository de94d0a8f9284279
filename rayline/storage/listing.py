"""A prefix's listing, streamed into parts: no process ever holds the whole of it.

A night of ten million photos is ten million keys: held as Python objects in
one driver that is gigabytes, and listed by one thread it is half an hour
before the first prediction. :func:`list_to_parts` instead

- looks at the prefix one level at a time (S3's ``Delimiter='/'``, a local
  ``scandir``) while it has few sub-prefixes (``dt=…/hour=…/``, ``<label>/``,
  hashed key prefixes ``00/``…``ff/``), at most :data:`MAX_DEPTH` levels down;
- hands the sub-prefixes it found, a group at a time, to Ray tasks that list
  each recursively, page by page (a flat prefix's own objects are streamed
  the same way by the caller);
- writes what is listed, every :data:`ROWS_PER_PART` objects, as a small
  Parquet file of URIs, keys, sizes and ETags (:data:`PART_SCHEMA`) under a
  staging folder, and keeps of each part only its row count and two
  :class:`~rayline.storage.digests.SetDigest` (of its URIs, and of its keys and
  ETags).

The content hash (:attr:`StreamedListing.content_hash`) is a function of the
*set* of (key, ETag) pairs, whatever the order of listing: it is built from the
sum of the digests. Not inputs, as before (:func:`rayline.storage.list_inputs`):
hidden or underscore names and folder markers, counted per reason with the
first few keys.

Part names are deterministic (``g<group>-<n>``, groups numbered in the order
the levels are looked at) and a part's rows keep the order of their listing
(S3: by key; local disk: the directory's own order, stable while it is
unchanged), so listing the same objects twice gives the same parts: what a
resumed night finds its blocks by.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from rayline import ray_work, storage
from rayline.errors import InputDataError, StorageError
from rayline.storage.digests import SetDigest, combine
from rayline.storage.walking import Entry, walkers

PART_SCHEMA = pa.schema(
    [("uri", pa.string()), ("key", pa.string()), ("size", pa.int64()), ("etag", pa.string()), ("modified", pa.string())]
)
ROWS_PER_PART = 100_000
# Sub-prefixes a level must have before its groups go to Ray tasks; with fewer, the next level is looked at.
FANOUT = 8
MAX_DEPTH = 3
PREFIXES_PER_GROUP = 8
# Objects the caller lists itself before it hands the remaining groups of sub-prefixes to Ray tasks.
INLINE_OBJECTS = 100_000
_EXAMPLES_PER_REASON = 5
# The form of the content hash: 1, the sha256 of the sorted listing (before); 2, of the set digest.
LISTING_VERSION = 2
_LISTING_TAG = "rayline-listing-v2"


@dataclass(frozen=True)
class ListedPart:
    """One Parquet file of a listing, and what the driver keeps of it."""

    uri: str
    name: str
    rows: int
    bytes: int
    uris: SetDigest  # of the objects' URIs: what a night's rows are checked against
    contents: SetDigest  # of "key<TAB>etag": the listing's identity

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: getattr(self, k) for k in ("uri", "name", "rows", "bytes")},
            "uris": self.uris.encode(),
            "contents": self.contents.encode(),
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> ListedPart:
        return cls(
            uri=str(row["uri"]),
            name=str(row["name"]),
            rows=int(row["rows"]),
            bytes=int(row["bytes"]),
            uris=SetDigest.decode(str(row["uris"])),
            contents=SetDigest.decode(str(row["contents"])),
        )


@dataclass
class _Skips:
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, key: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < _EXAMPLES_PER_REASON:
            shown.append(key or "./")  # "./": the listed prefix's own marker

    def merge(self, other: _Skips) -> None:
        for reason, count in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + count
            shown = self.examples.setdefault(reason, [])
            shown.extend(other.examples.get(reason, [])[: _EXAMPLES_PER_REASON - len(shown)])


@dataclass(frozen=True)
class _GroupListing:
    parts: list[ListedPart]
    skips: _Skips


def content_hash(contents: SetDigest) -> str:
    """The listing's identity: a sha256 of the set digest of its (key, ETag) pairs (64 hex digits)."""
    return hashlib.sha256(f"{_LISTING_TAG}\n{contents.encode()}".encode()).hexdigest()


def content_digest(key: str, etag: str) -> str:
    """The string a listing's content digest sums for one object."""
    return f"{key}\t{etag}"


@dataclass(frozen=True)
class StreamedListing:
    """A listed prefix: its parts, and the objects that are no inputs (per reason, the first keys of each)."""

    prefix: str
    parts: list[ListedPart]
    skipped: dict[str, int]
    skipped_examples: dict[str, list[str]]

    @property
    def count(self) -> int:
        return sum(part.rows for part in self.parts)

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self.parts)

    @property
    def uris(self) -> SetDigest:
        return combine(part.uris for part in self.parts)

    @property
    def contents(self) -> SetDigest:
        return combine(part.contents for part in self.parts)

    @property
    def content_hash(self) -> str:
        return content_hash(self.contents)


class _PartWriter:
    """Takes listed entries one by one and writes them out every ``rows_per_part``; skipped ones are counted."""

    def __init__(self, root: str, staging: str, group: str, rows_per_part: int) -> None:
        self.root, self.staging, self.group, self.rows_per_part = root.rstrip("/"), staging, group, rows_per_part
        self.parts: list[ListedPart] = []
        self.skips = _Skips()
        self._columns: dict[str, list[Any]] = {name: [] for name in PART_SCHEMA.names}

    def add(self, entry: Entry) -> None:
        reason = storage.skip_reason(entry.key, entry.size)
        if reason is not None:
            self.skips.add(reason, entry.key)
            return
        # not join(): a key ending in "/" keeps its slash, so the read is of that object
        row = (f"{self.root}/{entry.key}", entry.key, entry.size, entry.etag, entry.modified)
        for name, value in zip(PART_SCHEMA.names, row, strict=True):
            self._columns[name].append(value)
        if len(self._columns["uri"]) >= self.rows_per_part:
            self._flush()

    def _flush(self) -> None:
        columns, self._columns = self._columns, {name: [] for name in PART_SCHEMA.names}
        name = f"{self.group}-{len(self.parts):05d}"
        uri = storage.join(self.staging, f"{name}.parquet")
        storage.write_parquet_atomic(uri, pa.table(columns, schema=PART_SCHEMA))
        contents = (content_digest(k, e) for k, e in zip(columns["key"], columns["etag"], strict=True))
        self.parts.append(
            ListedPart(
                uri=uri,
                name=name,
                rows=len(columns["uri"]),
                bytes=sum(columns["size"]),
                uris=SetDigest.of(columns["uri"]),
                contents=SetDigest.of(contents),
            )
        )

    @property
    def count(self) -> int:
        """Inputs taken so far."""
        return sum(part.rows for part in self.parts) + len(self._columns["uri"])

    def close(self) -> _GroupListing:
        if self._columns["uri"]:
            self._flush()
        return _GroupListing(self.parts, self.skips)


def list_group(root: str, prefixes: list[str], staging: str, group: str, rows_per_part: int) -> _GroupListing:
    """List each of ``prefixes`` (relative to ``root``) recursively, into the parts of one group."""
    writer = _PartWriter(root, staging, group, rows_per_part)
    for _ in _listed_parts(writer, prefixes):
        pass
    return writer.close()


def _listed_parts(writer: _PartWriter, prefixes: list[str]) -> Iterator[ListedPart]:
    """List ``prefixes`` into ``writer``, yielding each part as it is written (the last one on close)."""
    _, walk_all = walkers(writer.root)
    written = 0
    for rel in prefixes:
        for entry in walk_all(writer.root, rel):
            writer.add(entry)
            if len(writer.parts) > written:
                written += 1
                yield writer.parts[-1]
    yield from writer.close().parts[written:]


def group_summary_uri(staging: str, group: str) -> str:
    """``<staging>/<group>.json``: a group's parts and skipped keys, written once the group is listed."""
    return storage.join(staging, f"{group}.json")


def list_group_parts(
    root: str, prefixes: list[str], staging: str, group: str, rows_per_part: int
) -> Iterator[ListedPart]:
    """List ``prefixes`` into the parts of ``group``, yielding each part as it is written; then write the
    group's summary (:func:`group_summary_uri`), which :func:`finish_listing` reads.

    What a night's block cutters run (:mod:`ray_workloads.night_blocks`): the
    first blocks are predicted while the rest of the prefix is still listed.
    """
    writer = _PartWriter(root, staging, group, rows_per_part)
    yield from _listed_parts(writer, prefixes)
    summary = {
        "parts": [part.to_json() for part in writer.parts],
        "skipped": writer.skips.counts,
        "examples": writer.skips.examples,
    }
    storage.write_json_atomic(group_summary_uri(staging, group), summary)


# --- the plan: levels in the caller, groups of sub-prefixes in Ray tasks ---------------------------------


class _Dispatcher:
    """Lists groups of sub-prefixes: in the caller while what it listed is small, then in Ray tasks.

    A small prefix is listed faster by the caller alone, into its own parts,
    than by tasks that each need a worker process (seconds apiece on a fresh
    cluster) and each write parts of their own; past :data:`INLINE_OBJECTS`
    listed objects the remaining groups go to Ray tasks, which list in
    parallel. Without a Ray connection everything is listed in the caller.
    Results are collected in group order. ``defer``: the remaining groups are
    only named (:attr:`deferred`), for a night's cutters to list
    (:func:`begin_listing`).
    """

    def __init__(self, own: _PartWriter, defer: bool = False) -> None:
        import ray

        self.own = own
        self.defer = defer
        self.own_prefixes = 0
        self.deferred: list[tuple[str, list[str]]] = []
        self._pending: list[str] = []
        self._refs: list[Any] = []
        self._remote = ray.remote(num_cpus=0.25)(list_group) if ray.is_initialized() else None

    def add(self, prefix: str) -> None:
        self._pending.append(prefix)
        if len(self._pending) >= PREFIXES_PER_GROUP:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        prefixes, self._pending = self._pending, []
        if (self._remote is None and not self.defer) or self.own.count < INLINE_OBJECTS:
            _, walk_all = walkers(self.own.root)
            for rel in prefixes:
                for entry in walk_all(self.own.root, rel):
                    self.own.add(entry)
            self.own_prefixes += len(prefixes)
            return
        group = f"g{len(self._refs) + len(self.deferred) + 1:05d}"  # g00000 is the caller's own parts
        if self.defer:
            self.deferred.append((group, prefixes))
            return
        assert self._remote is not None
        self._refs.append(self._remote.remote(self.own.root, prefixes, self.own.staging, group, self.own.rows_per_part))

    def gather(self) -> list[_GroupListing]:
        self.flush()
        return [self.own.close(), *(ray_work.gather(self._refs) if self._refs else [])]


def _walk_levels(root: str, own: _PartWriter, dispatcher: _Dispatcher) -> None:
    """The levels of ``root`` in the caller: its own objects into ``own``, groups of sub-prefixes to ``dispatcher``."""
    walk_level, _ = walkers(root)
    frontier = [""]
    for depth in range(MAX_DEPTH + 1):
        found: list[str] = []
        dispatching = depth == MAX_DEPTH
        for rel in frontier:
            for item in walk_level(root, rel):
                if isinstance(item, Entry):
                    own.add(item)  # a flat prefix: streamed page by page into the caller's own parts
                elif dispatching:
                    dispatcher.add(item)
                else:
                    found.append(item)  # few so far: perhaps worth looking one level further
                    if len(found) > FANOUT:  # many: this level's sub-prefixes go to tasks
                        dispatching = True
                        for prefix in found:
                            dispatcher.add(prefix)
                        found = []
        if not found:
            break
        frontier = found
    dispatcher.flush()


def _merged(root: str, listings: list[_GroupListing]) -> StreamedListing:
    skips = _Skips()
    for listing in listings:
        skips.merge(listing.skips)
    return StreamedListing(
        prefix=root,
        parts=[part for listing in listings for part in listing.parts],
        skipped=dict(sorted(skips.counts.items())),
        skipped_examples={reason: skips.examples[reason] for reason in sorted(skips.counts)},
    )


def _check_rows_per_part(rows_per_part: int) -> None:
    if rows_per_part < 1:
        raise InputDataError(f"rows_per_part must be at least 1, got {rows_per_part}")


def list_to_parts(prefix_uri: str, staging_uri: str, *, rows_per_part: int = ROWS_PER_PART) -> StreamedListing:
    """List everything under ``prefix_uri`` into Parquet parts under ``staging_uri`` (module docstring)."""
    _check_rows_per_part(rows_per_part)
    root = storage.normalize(prefix_uri)
    own = _PartWriter(root, staging_uri, "g00000", rows_per_part)
    dispatcher = _Dispatcher(own)
    _walk_levels(root, own, dispatcher)
    return _merged(root, dispatcher.gather())


@dataclass(frozen=True)
class ListingStart:
    """A prefix's listing begun by the caller: what it listed itself (:data:`INLINE_OBJECTS` or so, or
    everything), and the groups of sub-prefixes left, each to be listed by :func:`list_group_parts`."""

    prefix: str
    staging: str
    rows_per_part: int
    own: StreamedListing
    groups: list[tuple[str, list[str]]]  # (group name, sub-prefixes), in order
    own_prefixes: int  # sub-prefixes the caller listed itself

    @property
    def complete(self) -> bool:
        """Whether the caller listed everything (a small prefix): then :attr:`own` is the listing."""
        return not self.groups

    @property
    def estimated_count(self) -> int:
        """The objects the prefix holds, estimated from the sub-prefixes listed so far (exact when complete).

        Hashed or dated sub-prefixes hold about as many objects each; a
        function of the objects alone, so every run over the same objects
        estimates the same count (what a night's block size, part of the key
        its blocks are found by, is decided from).
        """
        left = sum(len(prefixes) for _, prefixes in self.groups)
        if not left or not self.own_prefixes:
            return self.own.count
        return self.own.count * (self.own_prefixes + left) // self.own_prefixes


def begin_listing(prefix_uri: str, staging_uri: str, *, rows_per_part: int = ROWS_PER_PART) -> ListingStart:
    """List ``prefix_uri``'s levels and its first :data:`INLINE_OBJECTS` objects or so in the caller, and name
    the groups of sub-prefixes left, for a night's cutters to list while the first blocks are predicted."""
    _check_rows_per_part(rows_per_part)
    root = storage.normalize(prefix_uri)
    own = _PartWriter(root, staging_uri, "g00000", rows_per_part)
    dispatcher = _Dispatcher(own, defer=True)
    _walk_levels(root, own, dispatcher)
    return ListingStart(
        prefix=root,
        staging=staging_uri,
        rows_per_part=rows_per_part,
        own=_merged(root, [own.close()]),
        groups=dispatcher.deferred,
        own_prefixes=dispatcher.own_prefixes,
    )


def finish_listing(start: ListingStart) -> StreamedListing:
    """The whole listing once every group of ``start`` was listed (:func:`list_group_parts`): read from
    the groups' summaries, one small file a group."""
    listings = [_GroupListing(start.own.parts, _own_skips(start.own))]
    for group, _ in start.groups:
        uri = group_summary_uri(start.staging, group)
        if not storage.exists(uri):  # written last: the group was never listed to its end
            raise StorageError(f"the listing of {start.prefix} has no summary of its group {group} ({uri})")
        summary = json.loads(storage.read_bytes(uri))
        skips = _Skips(dict(summary["skipped"]), {k: list(v) for k, v in summary["examples"].items()})
        listings.append(_GroupListing([ListedPart.from_json(part) for part in summary["parts"]], skips))
    return _merged(start.prefix, listings)


def _own_skips(listing: StreamedListing) -> _Skips:
    return _Skips(dict(listing.skipped), {k: list(v) for k, v in listing.skipped_examples.items()})


def read_part(part_uri: str) -> pa.Table:
    """One part's rows (:data:`PART_SCHEMA`)."""
    return storage.read_parquet([part_uri])


def iter_objects(listing: StreamedListing) -> Iterator[storage.ObjectInfo]:
    """The listed objects, one part in memory at a time."""
    for part in listing.parts:
        for row in read_part(part.uri).to_pylist():
            yield storage.ObjectInfo(row["uri"], row["key"], row["size"], row["etag"], row["modified"])
