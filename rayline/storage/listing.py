"""A prefix's listing, streamed into parts: no process ever holds the whole of it.

A night of ten million photos is ten million keys: held as Python objects in one driver that is gigabytes,
and listed by one thread it is half an hour before the first prediction. :func:`list_to_parts` instead

- looks at the prefix one level at a time while it has few sub-prefixes (``dt=…/hour=…/``, ``<label>/``,
  hashed key prefixes ``00/``…``ff/``), at most :data:`MAX_DEPTH` levels down;
- lists the sub-prefixes it found itself, page by page, until it has listed :data:`INLINE_OBJECTS` objects,
  perhaps inside a sub-prefix: the rest of that one (:data:`Prefix`) and the others go, in groups, to Ray
  tasks that list each recursively;
- writes what is listed, every :data:`ROWS_PER_PART` objects, as a small Parquet file under a staging folder,
  and keeps of each part only its row count and two set digests.

The content hash (:attr:`StreamedListing.content_hash`) is a function of the *set* of (key, ETag) pairs,
whatever the order of listing. Not inputs, as in :func:`rayline.storage.list_inputs`: hidden or underscore
names and folder markers, counted per reason with the first few keys.

Part names are deterministic (``g<group>-<n>``, groups numbered in the order the levels are looked at) and a
part's rows keep the order of their listing, by key on every store, where the caller also stops: listing the
same objects twice gives the same parts, what a resumed night finds its blocks by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rayline import ray_work, storage
from rayline.errors import InputDataError, StorageError
from rayline.storage.backends import Stat
from rayline.storage.listing_parts import (
    LISTING_VERSION,
    GroupListing,
    ListedPart,
    PartWriter,
    Prefix,
    Skips,
    StreamedListing,
    content_digest,
    content_hash,
    decode_prefixes,
    group_summary_uri,
    iter_objects,
    list_group,
    list_group_parts,
    own_skips,
    walk_below,
    walk_level,
)

__all__ = [
    "FANOUT",
    "INLINE_OBJECTS",
    "LISTERS",
    "LISTING_VERSION",
    "MAX_DEPTH",
    "PREFIXES_PER_GROUP",
    "ROWS_PER_PART",
    "ListingStart",
    "StreamedListing",
    "begin_listing",
    "content_digest",
    "content_hash",
    "decode_prefixes",
    "finish_listing",
    "iter_objects",
    "list_group_parts",
    "list_to_parts",
]

ROWS_PER_PART = 100_000
# Sub-prefixes a level must have before its groups go to Ray tasks; with fewer, the next level is looked at.
FANOUT = 8
MAX_DEPTH = 3
PREFIXES_PER_GROUP = 8
# Objects the caller lists itself before it hands the rest of the sub-prefixes to Ray tasks.
INLINE_OBJECTS = 100_000
# How many groups a night's cutters list at once (rayline.ray_workloads.nightly.pipeline), and so the fewest groups the
# sub-prefixes the caller left are cut into: with fewer, larger groups some of them would idle.
LISTERS = 8


class _Dispatcher:
    """Lists sub-prefixes: in the caller until it has listed :data:`INLINE_OBJECTS` objects, then in Ray tasks.

    A small prefix is listed faster by the caller alone than by tasks that each need a worker process (seconds
    apiece on a fresh cluster). The bound is one of objects, not of sub-prefixes (one ``hour=…/`` can hold
    millions): the caller stops inside a sub-prefix and leaves the rest of it with the other sub-prefixes, in
    groups of :data:`PREFIXES_PER_GROUP`, to Ray tasks. Without a Ray connection the caller lists everything.
    ``defer``: the groups are only named (:attr:`deferred`), for a night's cutters (:func:`begin_listing`).
    """

    def __init__(self, own: PartWriter, defer: bool = False) -> None:
        import ray

        self.own = own
        self.defer = defer
        self.own_prefixes = 0  # sub-prefixes the caller listed, whole or in part
        self.left: list[Prefix] = []  # what is left to list, in order (what defer names at the end)
        self._refs: list[Any] = []
        self._remote = ray.remote(num_cpus=0.25)(list_group) if ray.is_initialized() else None
        self._unbounded = self._remote is None and not defer  # no one else to list: the caller lists all

    def add(self, prefix: str) -> None:
        if not self.left and (self._unbounded or self.own.listed < INLINE_OBJECTS):
            self._list_here(prefix)
            return
        self.left.append((prefix, ""))
        if not self.defer and len(self.left) >= PREFIXES_PER_GROUP:
            self._send()

    def _list_here(self, prefix: str) -> None:
        """List ``prefix`` into the caller's own parts, up to the bound: the rest of it is left."""
        self.own_prefixes += 1
        for entry in walk_below(self.own.root, prefix):
            self.own.add(entry)
            if not self._unbounded and self.own.listed >= INLINE_OBJECTS:
                self.left.append((prefix, entry.key))  # walked in key order: the rest sorts after it
                return

    def _send(self) -> None:
        prefixes, self.left = self.left, []
        if not prefixes:
            return
        assert self._remote is not None
        group = f"g{len(self._refs) + 1:05d}"  # g00000 is the caller's own parts
        self._refs.append(self._remote.remote(self.own.root, prefixes, self.own.staging, group, self.own.rows_per_part))

    def flush(self) -> None:
        if not self.defer:
            self._send()

    @property
    def deferred(self) -> list[tuple[str, list[Prefix]]]:
        """What is left, cut into groups for at least :data:`LISTERS` listers (fewer when fewer sub-prefixes)."""
        size = max(1, min(PREFIXES_PER_GROUP, len(self.left) // LISTERS))
        chunks = [self.left[i : i + size] for i in range(0, len(self.left), size)]
        return [(f"g{n:05d}", chunk) for n, chunk in enumerate(chunks, start=1)]

    def gather(self) -> list[GroupListing]:
        self.flush()
        return [self.own.close(), *(ray_work.gather(self._refs) if self._refs else [])]


def _walk_levels(root: str, staging_uri: str, rows_per_part: int, *, defer: bool) -> _Dispatcher:
    """The levels of ``root`` in the caller: its own objects into the caller's own parts, sub-prefixes to the
    dispatcher returned."""
    if rows_per_part < 1:
        raise InputDataError(f"rows_per_part must be at least 1, got {rows_per_part}")
    own = PartWriter(root, staging_uri, "g00000", rows_per_part)
    dispatcher = _Dispatcher(own, defer)
    frontier = [""]
    for depth in range(MAX_DEPTH + 1):
        found: list[str] = []
        dispatching = depth == MAX_DEPTH
        for rel in frontier:
            for item in walk_level(root, rel):
                if isinstance(item, Stat):
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
    return dispatcher


def _merged(root: str, listings: list[GroupListing]) -> StreamedListing:
    skips = Skips()
    for listing in listings:
        skips.merge(listing.skips)
    return StreamedListing(
        prefix=root,
        parts=[part for listing in listings for part in listing.parts],
        skipped=dict(sorted(skips.counts.items())),
        skipped_examples={reason: skips.examples[reason] for reason in sorted(skips.counts)},
    )


def list_to_parts(prefix_uri: str, staging_uri: str, *, rows_per_part: int = ROWS_PER_PART) -> StreamedListing:
    """List everything under ``prefix_uri`` into Parquet parts under ``staging_uri`` (module docstring)."""
    root = storage.normalize(prefix_uri)
    return _merged(root, _walk_levels(root, staging_uri, rows_per_part, defer=False).gather())


@dataclass(frozen=True)
class ListingStart:
    """A prefix's listing begun by the caller: what it listed itself (:data:`INLINE_OBJECTS`, and a flat
    prefix's own objects, or everything), and the groups of sub-prefixes left, each to be listed by
    :func:`list_group_parts`."""

    prefix: str
    staging: str
    rows_per_part: int
    own: StreamedListing
    groups: list[tuple[str, list[Prefix]]]  # (group name, sub-prefixes), in order
    own_prefixes: int  # sub-prefixes the caller listed itself, whole or (the last) in part
    listers: int = LISTERS  # groups to list at once: the groups were cut for that many

    @property
    def complete(self) -> bool:
        """Whether the caller listed everything (a small prefix): then :attr:`own` is the listing."""
        return not self.groups

    @property
    def estimated_count(self) -> int:
        """The objects the prefix holds, as far as what was listed tells (exact when complete).

        Each sub-prefix not yet begun is counted as holding as many objects as the caller's sub-prefixes did
        on average (the last of them, perhaps listed in part, with only what was listed of it). A function of
        the objects alone, so every run over the same objects estimates the same count: a night's block
        size, part of the key its blocks are found by, is decided from it.
        """
        fresh = sum(1 for _, prefixes in self.groups for _, after in prefixes if not after)
        if not fresh or not self.own_prefixes:
            return self.own.count
        return self.own.count + self.own.count * fresh // self.own_prefixes


def begin_listing(prefix_uri: str, staging_uri: str, *, rows_per_part: int = ROWS_PER_PART) -> ListingStart:
    """List ``prefix_uri``'s levels and its first :data:`INLINE_OBJECTS` objects in the caller, and name the
    groups of sub-prefixes left, for a night's cutters to list while the first blocks are predicted."""
    root = storage.normalize(prefix_uri)
    dispatcher = _walk_levels(root, staging_uri, rows_per_part, defer=True)
    return ListingStart(
        prefix=root,
        staging=staging_uri,
        rows_per_part=rows_per_part,
        own=_merged(root, [dispatcher.own.close()]),
        groups=dispatcher.deferred,
        own_prefixes=dispatcher.own_prefixes,
    )


def finish_listing(start: ListingStart) -> StreamedListing:
    """The whole listing once every group of ``start`` was listed (:func:`list_group_parts`): read from
    the groups' summaries, one small file a group."""
    listings = [GroupListing(start.own.parts, own_skips(start.own))]
    for group, _ in start.groups:
        uri = group_summary_uri(start.staging, group)
        if not storage.exists(uri):  # written last: the group was never listed to its end
            raise StorageError(f"the listing of {start.prefix} has no summary of its group {group} ({uri})")
        summary = json.loads(storage.read_bytes(uri))
        skips = Skips(dict(summary["skipped"]), {k: list(v) for k, v in summary["examples"].items()})
        listings.append(GroupListing([ListedPart.from_json(part) for part in summary["parts"]], skips))
    return _merged(start.prefix, listings)
