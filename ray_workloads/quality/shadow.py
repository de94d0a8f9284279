"""A shadowed night: a second version scored in the same pass as the champion, compared with it.

The predictor decodes each image once and scores it with both versions; the shadow's rows go to the
``shadow_predictions`` table, keyed like ``predictions`` (model_name, dt; rows by URI and ETag, the
shadow's version in ``model_version``). It is committed after the errors and before the predictions, whose
commit stays the night's done marker: a run that dies between them left no committed night, and its rerun
replaces the shadow's rows with its own. The comparison (:func:`compare`) is read from the compacted files
before the commits and kept in the shadow commit's info, so a retry after the commit returns it too.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import StorageError
from rayline.models.registry import ModelVersion
from rayline.storage.layout import PREDICTIONS_TABLE, SHADOW_TABLE, table_uri
from rayline.tables.delta_tables import Night, find_commit, open_table, storage_options


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
    class_shift: float = Field(
        description="Total variation distance between the two versions' predicted-class distributions (0..1)."
    )
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


SUMMARY_KEY = "rayline.shadow_summary"
_COLUMNS = ["uri", "predicted_class", "confidence"]


def _read(files: list[str]) -> pa.Table:
    return storage.read_parquet(files, columns=_COLUMNS) if files else pa.table({c: [] for c in _COLUMNS})


def class_shift(first: Counter[str], second: Counter[str]) -> float:
    """Total variation distance between two class distributions: half the summed gaps of their shares."""
    n1, n2 = sum(first.values()), sum(second.values())
    if not n1 or not n2:
        return 0.0
    return 0.5 * sum(abs(first[c] / n1 - second[c] / n2) for c in set(first) | set(second))


def compare(
    predictions: list[str], shadow: list[str], shadow_version: ModelVersion, table: str, inputs: int
) -> ShadowSummary:
    """The shadow's night against the champion's, from their files (``table_version`` is set at the commit)."""
    champion, shadowed = _read(predictions), _read(shadow)
    if shadowed.num_rows > inputs:
        raise StorageError(
            f"refusing to commit: the shadow's files hold {shadowed.num_rows} rows, more than the night's "
            f"{inputs} inputs; nothing was committed"
        )
    joined = champion.join(shadowed, "uri", right_suffix="_shadow", join_type="inner")
    compared = joined.num_rows
    same = pc.sum(pc.equal(joined["predicted_class"], joined["predicted_class_shadow"])).as_py() or 0
    counts = Counter(str(c) for c in joined["predicted_class"].to_pylist())
    shadow_counts = Counter(str(c) for c in joined["predicted_class_shadow"].to_pylist())
    return ShadowSummary(
        model_version=shadow_version.version,
        weights_uri=shadow_version.weights_uri,
        table=table,
        table_version=-1,
        rows=shadowed.num_rows,
        compared=compared,
        agreement=same / compared if compared else 0.0,
        mean_confidence=_mean(joined["confidence"]),
        shadow_mean_confidence=_mean(joined["confidence_shadow"]),
        class_shift=class_shift(counts, shadow_counts),
        class_counts=dict(sorted(counts.items())),
        shadow_class_counts=dict(sorted(shadow_counts.items())),
    )


def _mean(column: Any) -> float:
    return float(pc.mean(column).as_py() or 0.0) if len(column) else 0.0


def as_metadata(summary: ShadowSummary) -> dict[str, str]:
    """The summary for the shadow commit's info (its table version is the commit's own)."""
    return {SUMMARY_KEY: summary.model_dump_json(exclude={"table_version"})}


def from_commit_info(info: dict[str, Any], version: int) -> ShadowSummary | None:
    """The summary a shadow commit holds (:func:`as_metadata`), at the commit's ``version``."""
    text = info.get(SUMMARY_KEY)
    if text is None:
        return None
    return ShadowSummary.model_validate({**json.loads(str(text)), "table_version": version})


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
        summary = from_commit_info(dict(commit.info), commit.version)
        if summary is not None:
            found[dt] = summary
    return found
