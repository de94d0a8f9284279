"""A shadowed night: a second version scored in the same pass as the champion, compared with it.

The shadow's rows go to the ``shadow_predictions`` table, keyed like ``predictions``. It is committed after
the errors and before the predictions, whose commit stays the night's done marker: a rerun replaces the
rows of a run that died between them.

The comparison is summed block by block, so the driver holds counts, never the night's rows: each actor
counts its block (:func:`block_counts`), the driver adds them up (:class:`ShadowCounts`), checks them
against the compacted shadow files and keeps the summary in the shadow commit's info (:func:`summarize`),
so a retry after the commit returns it too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from pydantic import BaseModel, Field

from rayline.errors import StorageError
from rayline.models.registry import ModelVersion
from rayline.storage.digests import SetDigest
from rayline.storage.layout import PREDICTIONS_TABLE, SHADOW_TABLE, table_uri
from rayline.tables.delta_tables import Night, NightCommit, find_commit, open_table, storage_options


class ShadowSummary(BaseModel):
    """How a shadow version's answers compared with the champion's on one night (same images, same pass)."""

    model_version: int = Field(description="The shadow version.")
    weights_uri: str
    table: str = Field(description="The shadow_predictions table.")
    table_version: int = Field(description="Its version holding this night's shadow rows.")
    rows: int = Field(description="Images the shadow scored: those the champion predicted or could have.")
    compared: int = Field(description="Images both versions predicted.")
    agreement: float = Field(description="Share of compared images where both predicted the same class.")
    mean_confidence: float = Field(description="The champion's mean top-1 confidence over the compared images.")
    shadow_mean_confidence: float
    class_shift: float = Field(description="Total variation distance of the two predicted-class distributions.")
    class_counts: dict[str, int] = Field(default_factory=dict, description="The champion's predictions per class.")
    shadow_class_counts: dict[str, int] = Field(default_factory=dict)

    @property
    def confidence_change(self) -> float:
        return self.shadow_mean_confidence - self.mean_confidence

    def line(self) -> str:
        """The shadow's night in a line: its version, agreement, and how its confidence and classes moved."""
        return (
            f"v{self.model_version}: agreement {self.agreement:.1%} on {self.compared:,} images, mean confidence "
            f"{self.mean_confidence:.3f} → {self.shadow_mean_confidence:.3f} ({self.confidence_change:+.3f}), "
            f"class shift {self.class_shift:.3f} (total variation); {self.table} (Delta version {self.table_version})"
        )


_COLUMNS = ["uri", "predicted_class", "confidence"]
# a float32 is a whole multiple of 2**-149: summed as such integers, confidences add up alike in any order
_UNIT_BITS = 149


def class_shift(first: Counter[str], second: Counter[str]) -> float:
    """Total variation distance between two class distributions: half the summed gaps of their shares."""
    n1, n2 = sum(first.values()), sum(second.values())
    if not n1 or not n2:
        return 0.0
    return 0.5 * sum(abs(first[c] / n1 - second[c] / n2) for c in sorted(set(first) | set(second)))


@dataclass
class ShadowCounts:
    """A shadowed night's comparison in sums that add up block by block (a block's predictions and shadow rows
    are of the same images): what the driver holds of it. Confidences are summed exactly (``_UNIT_BITS``);
    ``uris`` digests the shadow's rows, checked against the committed files (:func:`summarize`)."""

    rows: int = 0  # the shadow's rows
    compared: int = 0  # images both versions predicted
    same: int = 0  # of those, predicted as the same class
    confidence_units: int = 0  # the champion's confidences over the compared images, in 2**-149
    shadow_confidence_units: int = 0
    finite: bool = True  # False once a confidence was NaN or infinite: the means are NaN then
    class_counts: dict[str, int] = field(default_factory=dict)  # over the compared images
    shadow_class_counts: dict[str, int] = field(default_factory=dict)
    uris: SetDigest = SetDigest()

    def add(self, other: ShadowCounts) -> None:
        """Add ``other``'s counts to these, in place: a night's total grows by a block at a time, and its class
        counts stay one dict of at most the model's classes."""
        self.rows += other.rows
        self.compared += other.compared
        self.same += other.same
        self.confidence_units += other.confidence_units
        self.shadow_confidence_units += other.shadow_confidence_units
        self.finite = self.finite and other.finite
        for mine, theirs in (
            (self.class_counts, other.class_counts),
            (self.shadow_class_counts, other.shadow_class_counts),
        ):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count
        self.uris = self.uris + other.uris

    @classmethod
    def total(cls, parts: Iterable[ShadowCounts]) -> ShadowCounts:
        summed = cls()
        for part in parts:
            summed.add(part)
        return summed

    def to_json(self) -> str:
        """How a block's counts travel in its report (integers of any size: JSON keeps them exact)."""
        return json.dumps({**dataclasses.asdict(self), "uris": self.uris.encode()}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ShadowCounts:
        fields = json.loads(text)
        return cls(**{**fields, "uris": SetDigest.decode(fields["uris"])})

    def mean_confidence(self, shadow: bool = False) -> float:
        """The mean over the compared images, rounded once from the exact sum."""
        if not self.compared:
            return 0.0
        if not self.finite:
            return math.nan
        units = self.shadow_confidence_units if shadow else self.confidence_units
        return float(Fraction(units, self.compared << _UNIT_BITS))


def exact_units(values: np.ndarray) -> tuple[int, bool]:
    """The exact sum of the finite float32 ``values`` in units of 2**-149, and whether every value was finite."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    exponent = (bits >> 23) & 0xFF
    finite = exponent != 0xFF
    # value = significand * 2**(max(exponent, 1) - 150) = significand << (max(exponent, 1) - 1) units
    significand = np.where(exponent > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF).astype(np.int64)
    signed = np.where(bits >> 31 == 1, -significand, significand)
    shift = np.maximum(exponent.astype(np.int64), 1) - 1
    total = 0
    for step in np.unique(shift[finite]):  # at most 254 exponents: one integer sum per exponent
        total += int(signed[finite & (shift == step)].sum()) << int(step)
    return total, bool(finite.all())


def _class_counts(column: pa.ChunkedArray) -> dict[str, int]:
    counts = pc.value_counts(column) if len(column) else []
    return {str(entry["values"]): int(entry["counts"]) for entry in (c.as_py() for c in counts)}


def block_counts(predictions: pa.Table, shadow: pa.Table) -> ShadowCounts:
    """One block's :class:`ShadowCounts`: its predictions and shadow rows joined on URI (images both predicted)."""
    champion, shadowed = predictions.select(_COLUMNS), shadow.select(_COLUMNS)
    joined = champion.join(shadowed, "uri", right_suffix="_shadow", join_type="inner")
    same = pc.sum(pc.equal(joined["predicted_class"], joined["predicted_class_shadow"])).as_py() or 0
    units, finite = exact_units(joined["confidence"].to_numpy())
    shadow_units, shadow_finite = exact_units(joined["confidence_shadow"].to_numpy())
    return ShadowCounts(
        rows=shadowed.num_rows,
        compared=joined.num_rows,
        same=int(same),
        confidence_units=units,
        shadow_confidence_units=shadow_units,
        finite=finite and shadow_finite,
        class_counts=_class_counts(joined["predicted_class"]),
        shadow_class_counts=_class_counts(joined["predicted_class_shadow"]),
        uris=SetDigest.of(shadowed.column("uri").to_pylist()),
    )


def summarize(
    counts: ShadowCounts, committed: SetDigest, shadow_version: ModelVersion, table: str, inputs: int
) -> ShadowSummary:
    """The night's summary from its blocks' summed counts (``table_version`` is set at the commit), which must
    describe exactly the shadow rows of the files to commit (``committed``), and no more than ``inputs``."""
    if counts.rows > inputs:
        raise StorageError(
            f"refusing to commit: the shadow's blocks hold {counts.rows} rows, more than the night's "
            f"{inputs} inputs; nothing was committed"
        )
    if counts.uris != committed:
        raise StorageError(
            f"refusing to commit: the shadow's block reports name {counts.uris.count} rows (digest "
            f"{counts.uris.hex[:12]}…), its compacted files {committed.count} ({committed.hex[:12]}…); "
            "nothing was committed"
        )
    compared = counts.compared
    champion, shadowed = Counter(counts.class_counts), Counter(counts.shadow_class_counts)
    return ShadowSummary(
        model_version=shadow_version.version,
        weights_uri=shadow_version.weights_uri,
        table=table,
        table_version=-1,
        rows=counts.rows,
        compared=compared,
        agreement=counts.same / compared if compared else 0.0,
        mean_confidence=counts.mean_confidence(),
        shadow_mean_confidence=counts.mean_confidence(shadow=True),
        class_shift=class_shift(champion, shadowed),
        class_counts=dict(sorted(champion.items())),
        shadow_class_counts=dict(sorted(shadowed.items())),
    )


def as_record(summary: ShadowSummary) -> dict[str, Any]:
    """The summary as the shadow commit records it (``NightCommit.shadow_summary``; its version is the commit's)."""
    return summary.model_dump(exclude={"table_version"})


def committed_summary(commit: NightCommit) -> ShadowSummary | None:
    """The summary a shadow commit holds (:func:`as_record`), at the commit's version."""
    if commit.shadow_summary is None:
        return None
    return ShadowSummary.model_validate({**commit.shadow_summary, "table_version": commit.version})


def night_summaries(root: str, model_name: str, nights: list[str]) -> dict[str, ShadowSummary]:
    """The shadow's comparison of each of ``nights`` whose committed run shadowed it (read from the shadow
    commit's info; a night run again without a shadow has none, whatever an earlier run left)."""
    uri, served_uri = table_uri(root, SHADOW_TABLE), table_uri(root, PREDICTIONS_TABLE)
    if not nights or not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return {}
    tbl, served = open_table(uri), open_table(served_uri)
    found = {}
    for dt in nights:
        night = Night(model_name, dt)
        commit, done = find_commit(uri, tbl, night), find_commit(served_uri, served, night)
        if commit is None or done is None or commit.run_id != done.run_id:
            continue
        summary = committed_summary(commit)
        if summary is not None:
            found[dt] = summary
    return found
