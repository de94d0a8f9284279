"""Order-independent digests of sets of strings: what a night's listing and its written rows are checked by.

A :class:`SetDigest` is a count and the sum, modulo 2**128, of a 128-bit BLAKE2b hash of each string. Sums
commute, so a digest can be built in parts, in any order and on any machine, and the parts added. Two digests
are equal when the two multisets of strings are, up to the bound below, so the driver checks "predictions
plus errors name every listed input exactly once" by comparing two numbers instead of reading every URI back.

Collision bound. For two different multisets with the same count, the digests agree only if
``Σ c_i·h(x_i) ≡ 0 (mod 2**128)``, where ``c_i`` is how many more times ``x_i`` is in one multiset than in
the other. With ``h`` uniform, that happens with probability at most ``2**-(128 - k)`` when every
``|c_i| < 2**k``: for a row missing, duplicated or extra a few times, about ``2**-126``. This guards against
bugs and lost or doubled writes, not against an adversary who picks the strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

_BITS = 128
_MASK = (1 << _BITS) - 1


def item_hash(text: str) -> int:
    """The 128-bit hash of one string that a digest sums."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=_BITS // 8).digest(), "little")


@dataclass(frozen=True)
class SetDigest:
    """How many strings, and the sum of their hashes modulo 2**128."""

    count: int = 0
    total: int = 0

    @classmethod
    def of(cls, texts: Iterable[str]) -> SetDigest:
        count = total = 0
        for text in texts:
            count += 1
            total += item_hash(text)
        return cls(count, total & _MASK)

    def __add__(self, other: SetDigest) -> SetDigest:
        return SetDigest(self.count + other.count, (self.total + other.total) & _MASK)

    @property
    def hex(self) -> str:
        return f"{self.total:032x}"

    def encode(self) -> str:
        """``<count>:<32 hex digits>``: how digests travel in reports and file metadata."""
        return f"{self.count}:{self.hex}"

    @classmethod
    def decode(cls, text: str) -> SetDigest:
        count, _, total = text.partition(":")
        return cls(int(count), int(total, 16))


def combine(digests: Iterable[SetDigest]) -> SetDigest:
    return sum(digests, SetDigest())
