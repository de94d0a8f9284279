"""How right each version was, night by night: its predictions joined with people's labels on (URI, ETag).

Per version and night: the labelled count, accuracy, per-class recall, and the expected calibration error
(ECE: over ``ECE_BINS`` equal-width confidence bins, the gap between a bin's accuracy and mean confidence,
weighted by its share). A photo predicted on several nights counts on each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError
from pydantic import BaseModel, Field

from rayline.ray_workloads.quality.paired import PairedTest
from rayline.storage.layout import PREDICTIONS_TABLE, table_uri
from rayline.tables.delta_tables import open_table, storage_error, storage_options

ECE_BINS = 10
JOINED_COLUMNS = ("uri", "etag", "dt", "model_version", "predicted_index", "confidence")


class Quality(BaseModel):
    """A version's labelled figures over some photos."""

    labelled: int = Field(description="Labelled photos the version predicted.")
    correct: int
    accuracy: float
    ece: float = Field(description="Expected calibration error: 0 when confidence matches accuracy.")
    recall: dict[str, float] = Field(description="Per class labelled at least once: the share predicted as it.")


class NightQuality(Quality):
    model_name: str
    model_version: int
    dt: str
    table: str = Field(PREDICTIONS_TABLE, description="The table its predictions are in.")
    left_out: int = Field(0, description="Labelled photos of the night not counted: not evidence (evidence.py).")

    @property
    def role(self) -> str:
        """``served``: the version predicted the night; ``shadow``: it was scored in the night's shadow."""
        return "served" if self.table == PREDICTIONS_TABLE else "shadow"


class QualityReading(BaseModel):
    """What the monitor learns from the labels: each version's nights, and the challenger's paired test."""

    nights: list[NightQuality] = Field(default_factory=list)
    paired: PairedTest | None = None


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> float:
    """ECE over ``bins`` equal-width bins of (0, 1]; 0.0 for no photos."""
    if confidence.size == 0:
        return 0.0
    which = np.clip(np.ceil(confidence * bins).astype(int) - 1, 0, bins - 1)
    gap = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            gap += inside.mean() * abs(float(correct[inside].mean()) - float(confidence[inside].mean()))
    return gap


def score(predicted: np.ndarray, labels: np.ndarray, confidence: np.ndarray, classes: Sequence[str]) -> Quality:
    """The figures of predictions against labels (class indices), with each prediction's confidence."""
    correct = predicted == labels
    recall = {
        classes[c] if 0 <= c < len(classes) else str(c): float(correct[labels == c].mean())
        for c in sorted(set(labels.tolist()))
    }
    return Quality(
        labelled=int(labels.size),
        correct=int(correct.sum()),
        accuracy=float(correct.mean()) if labels.size else 0.0,
        ece=expected_calibration_error(confidence.astype(np.float64), correct),
        recall=recall,
    )


def labelled_predictions(
    root: str, model_name: str, labels: pa.Table, table: str = PREDICTIONS_TABLE, nights: Sequence[str] | None = None
) -> pa.Table:
    """``table``'s rows of ``model_name`` for labelled photos, each with its ``label_index``; ``nights`` (``dt``
    values) confines the read to those nights' partitions (None: every night)."""
    uri = table_uri(root, table)
    nothing = labels.num_rows == 0 or (nights is not None and not nights)
    if nothing or not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return _empty_joined()
    partitions: list[tuple[str, str, Any]] = [("model_name", "=", model_name)]
    if nights is not None:
        partitions.append(("dt", "in", sorted(set(nights))))
    try:
        rows = (
            open_table(uri)
            .to_pyarrow_dataset(file_pruning_predicate=partitions)
            .to_table(
                columns=list(JOINED_COLUMNS),
                filter=(pc.field("model_name") == model_name) & pc.field("uri").isin(labels["uri"].unique()),
                use_threads=False,
            )
        )
    except (DeltaError, OSError) as exc:
        raise storage_error(exc, "read", uri) from exc
    return rows.join(labels.select(["uri", "etag", "label_index"]), keys=["uri", "etag"], join_type="inner")


def _empty_joined() -> pa.Table:
    schema = pa.schema(
        [("uri", pa.string()), ("etag", pa.string()), ("dt", pa.string()), ("model_version", pa.int64()),
         ("predicted_index", pa.int64()), ("confidence", pa.float32()), ("label_index", pa.int64())]
    )  # fmt: skip
    return schema.empty_table()


def _score_part(part: pa.Table, classes: Sequence[str]) -> Quality:
    return score(
        part["predicted_index"].to_numpy(), part["label_index"].to_numpy(), part["confidence"].to_numpy(), classes
    )


def night_quality(
    joined: pa.Table,
    model_name: str,
    classes: Sequence[str],
    table: str = PREDICTIONS_TABLE,
    left_out: Mapping[tuple[int, str], int] | None = None,
) -> list[NightQuality]:
    """Each (version, night) of ``joined``, oldest night first; ``left_out``: each one's photos not counted."""
    keys = set(zip(joined["model_version"].to_pylist(), joined["dt"].to_pylist(), strict=True))
    return [
        NightQuality(
            model_name=model_name,
            model_version=version,
            dt=dt,
            table=table,
            left_out=(left_out or {}).get((version, dt), 0),
            **_score_part(
                joined.filter((pc.field("model_version") == version) & (pc.field("dt") == dt)), classes
            ).model_dump(),
        )
        for version, dt in sorted(keys, key=lambda k: (k[1], k[0]))
    ]


def version_quality(joined: pa.Table, classes: Sequence[str]) -> dict[int, Quality]:
    """Each version's figures over all of ``joined``'s nights together."""
    return {
        version: _score_part(joined.filter(pc.field("model_version") == version), classes)
        for version in sorted(set(joined["model_version"].to_pylist()))
    }
