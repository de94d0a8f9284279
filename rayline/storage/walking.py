"""Walking a prefix on any store: one level (objects and sub-prefixes), or everything below.

What :mod:`rayline.storage.listing` builds its parts from: each walker yields
:class:`Entry` objects with keys relative to the listed root, page by page
(the store's own listing: ``ListObjectsV2``, GCS's and Azure's list calls, a
local ``scandir``), never a whole listing, in the order of their keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rayline import storage


@dataclass(frozen=True)
class Entry:
    """One listed object, its key relative to the listed root."""

    key: str
    size: int
    etag: str
    modified: str


def _prefix(root: str, rel: str) -> str:
    """The URI of the sub-prefix ``rel`` of ``root``, exactly: ``rel`` ends with the slash its store named it with,
    so ``a//`` stays a sub-prefix of its own below ``a/``."""
    return f"{root.rstrip('/')}/{rel}" if rel else root


def _level(root: str, rel: str) -> Iterator[Entry | str]:
    """One level: the objects directly under ``rel``, and its sub-prefixes as the store names them, slash kept.

    Keys are opaque: ``a//`` is a sub-prefix of its own below ``a/``, never ``a``
    again, so a key with doubled slashes is listed once, under its own key.
    """
    with storage.storage_errors("listing", _prefix(root, rel)):
        for page in storage.store(root).list_pages(_prefix(root, rel), level=True):
            for stat in page.objects:
                yield Entry(rel + stat.key, stat.size, stat.version, stat.modified)
            for sub in page.prefixes:
                yield rel + sub


def _below(root: str, rel: str, after: str = "") -> Iterator[Entry]:
    """Every object below ``rel`` whose key (relative to ``root``) sorts after ``after``, in key order."""
    if after and not after.startswith(rel):
        if after > rel:
            return  # every key below ``rel`` sorts before ``after``
        after = ""
    with storage.storage_errors("listing", _prefix(root, rel)):
        pages = storage.store(root).list_pages(_prefix(root, rel), after=after[len(rel) :])
        for page in pages:
            for stat in page.objects:
                yield Entry(rel + stat.key, stat.size, stat.version, stat.modified)


LevelWalker = Callable[[str, str], Iterator[Entry | str]]
# (root, sub-prefix, after): the objects below the sub-prefix whose keys sort after ``after`` ("": all), in key order
TreeWalker = Callable[[str, str, str], Iterator[Entry]]


def walkers(root: str) -> tuple[LevelWalker, TreeWalker]:
    """The level and tree walkers of ``root``'s store.

    A sub-prefix is what the level walker named (its key relative to
    ``root``, its slash kept), to be passed back to the walkers as it is.
    Both walk in key order, so ``after`` resumes a walk past the last key
    taken.
    """
    return _level, _below
