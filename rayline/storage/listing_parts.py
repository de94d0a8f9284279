"""The parts of a streamed listing: walking a prefix, Parquet files of listed objects, what is kept of each.

:mod:`rayline.storage.listing` plans who lists which sub-prefix; what is walked (:func:`walk_level`,
:func:`walk_below`: page by page, in key order, never a whole listing) goes through a :class:`PartWriter` into
parts (:data:`PART_SCHEMA`), each kept as its row count and two set digests (:class:`ListedPart`), and the
objects that are no inputs counted per reason (:class:`Skips`).

Keys are relative to the listed root, and a sub-prefix is what :func:`walk_level` named (its slash kept), to
be passed back as it is: keys are opaque, so ``a//`` is a sub-prefix of its own below ``a/``, and a key with
doubled slashes is listed once, under its own key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa

from rayline import storage
from rayline.storage.backends import Stat
from rayline.storage.digests import SetDigest, combine

PART_SCHEMA = pa.schema(
    [("uri", pa.string()), ("key", pa.string()), ("size", pa.int64()), ("etag", pa.string()), ("modified", pa.string())]
)
_EXAMPLES_PER_REASON = 5
# The form of the content hash: 1, the sha256 of the sorted listing (before); 2, of the set digest.
LISTING_VERSION = 2
_LISTING_TAG = "rayline-listing-v2"


# A sub-prefix to list, relative to the listed prefix, as :func:`walk_level` named it, and the key after which
# to list it ("": all of it).
Prefix = tuple[str, str]


def _prefix(root: str, rel: str) -> str:
    """The URI of the sub-prefix ``rel`` of ``root``, exactly (``rel`` keeps the slash its store named it with)."""
    return f"{root.rstrip('/')}/{rel}" if rel else root


def walk_level(root: str, rel: str) -> Iterator[Stat | str]:
    """The objects directly under ``rel``, and its sub-prefixes as the store names them, slash kept."""
    with storage.storage_errors("listing", _prefix(root, rel)):
        for page in storage.store(root).list_pages(_prefix(root, rel), level=True):
            yield from (replace(stat, key=rel + stat.key) for stat in page.objects)
            yield from (rel + sub for sub in page.prefixes)


def walk_below(root: str, rel: str, after: str = "") -> Iterator[Stat]:
    """Every object below ``rel`` whose key sorts after ``after`` ("": all), in key order: ``after`` resumes a
    walk past the last key taken."""
    if after and not after.startswith(rel):
        if after > rel:
            return  # every key below ``rel`` sorts before ``after``
        after = ""
    with storage.storage_errors("listing", _prefix(root, rel)):
        for page in storage.store(root).list_pages(_prefix(root, rel), after=after[len(rel) :]):
            yield from (replace(stat, key=rel + stat.key) for stat in page.objects)


def decode_prefixes(text: str) -> list[Prefix]:
    """The sub-prefixes of a group from their JSON (a list of ``[prefix, after]``: what ``json.dumps`` writes)."""
    return [(str(rel), str(after)) for rel, after in json.loads(text)]


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
        return {**asdict(self), "uris": self.uris.encode(), "contents": self.contents.encode()}

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
class Skips:
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, key: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < _EXAMPLES_PER_REASON:
            shown.append(key or "./")  # "./": the listed prefix's own marker

    def merge(self, other: Skips) -> None:
        for reason, count in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + count
            shown = self.examples.setdefault(reason, [])
            shown.extend(other.examples.get(reason, [])[: _EXAMPLES_PER_REASON - len(shown)])


@dataclass(frozen=True)
class GroupListing:
    parts: list[ListedPart]
    skips: Skips


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


class PartWriter:
    """Takes listed entries one by one and writes them out every ``rows_per_part``; skipped ones are counted."""

    def __init__(self, root: str, staging: str, group: str, rows_per_part: int) -> None:
        self.root, self.staging, self.group, self.rows_per_part = root.rstrip("/"), staging, group, rows_per_part
        self.parts: list[ListedPart] = []
        self.skips = Skips()
        self.listed = 0  # objects taken, inputs or not
        self._columns: dict[str, list[Any]] = {name: [] for name in PART_SCHEMA.names}

    def add(self, entry: Stat) -> None:
        self.listed += 1
        reason = storage.skip_reason(entry.key, entry.size)
        if reason is not None:
            self.skips.add(reason, entry.key)
            return
        row = (storage.object_uri(self.root, entry.key), entry.key, entry.size, entry.version, entry.modified)
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

    def close(self) -> GroupListing:
        if self._columns["uri"]:
            self._flush()
        return GroupListing(self.parts, self.skips)


def list_group(root: str, prefixes: list[Prefix], staging: str, group: str, rows_per_part: int) -> GroupListing:
    """List each of ``prefixes`` (relative to ``root``) recursively, into the parts of one group."""
    writer = PartWriter(root, staging, group, rows_per_part)
    for _ in _listed_parts(writer, prefixes):
        pass
    return writer.close()


def _listed_parts(writer: PartWriter, prefixes: list[Prefix]) -> Iterator[ListedPart]:
    """List ``prefixes`` into ``writer``, yielding each part as it is written (the last one on close)."""
    written = 0
    for rel, after in prefixes:
        for entry in walk_below(writer.root, rel, after):
            writer.add(entry)
            if len(writer.parts) > written:
                written += 1
                yield writer.parts[-1]
    yield from writer.close().parts[written:]


def group_summary_uri(staging: str, group: str) -> str:
    """``<staging>/<group>.json``: a group's parts and skipped keys, written once the group is listed."""
    return storage.join(staging, f"{group}.json")


def list_group_parts(
    root: str, prefixes: list[Prefix], staging: str, group: str, rows_per_part: int
) -> Iterator[ListedPart]:
    """List ``prefixes`` into the parts of ``group``, yielding each part as it is written; then write the
    group's summary (:func:`group_summary_uri`). What a night's block cutters run: the first blocks are
    predicted while the rest of the prefix is still listed.
    """
    writer = PartWriter(root, staging, group, rows_per_part)
    yield from _listed_parts(writer, prefixes)
    summary = {
        "parts": [part.to_json() for part in writer.parts],
        "skipped": writer.skips.counts,
        "examples": writer.skips.examples,
    }
    storage.write_json_atomic(group_summary_uri(staging, group), summary)


def own_skips(listing: StreamedListing) -> Skips:
    return Skips(dict(listing.skipped), {k: list(v) for k, v in listing.skipped_examples.items()})


def read_part(part_uri: str) -> pa.Table:
    """One part's rows (:data:`PART_SCHEMA`)."""
    return storage.read_parquet([part_uri])


def iter_objects(listing: StreamedListing) -> Iterator[storage.ObjectInfo]:
    """The listed objects, one part in memory at a time."""
    for part in listing.parts:
        for row in read_part(part.uri).to_pylist():
            yield storage.ObjectInfo(row["uri"], row["key"], row["size"], row["etag"], row["modified"])
