"""What to label next: a night's photos ranked by how much a label would teach, within a budget.

Each predicted photo of the night gets three scores, each in [0, 1]:

* **uncertainty**: one minus the margin between the champion's two most probable classes (a photo it
  nearly called otherwise);
* **disagreement**: 1 when the version scored in the night's shadow predicted another class, else 0;
* **drift**: how much more often the night predicted the photo's class than the reference does (the
  champion's training labels, or its first night), ``log(night share / reference share) / log(4)``
  clipped to [0, 1]: a class predicted four times as often scores 1; where the night's photos moved.

Its priority is ``0.5 · uncertainty + 0.3 · disagreement + 0.2 · drift`` (``QueueConfig.weights``); the
``budget`` photos of highest priority not yet labelled (at the ETag predicted) are queued, ties by URI.
The queue is a Label Studio task file (JSON: the photo, and the champion's answer as a pre-annotation of a
``Choices`` control named ``label`` on an ``Image`` named ``image``) and a CSV with the same photos, whose
empty ``label`` column, filled in, is what ``rayline labels import`` takes back.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import Counter
from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import InputDataError
from rayline.lineage import DatasetRef
from rayline.storage.layout import LABEL_QUEUES_DIR, PREDICTIONS_TABLE, SHADOW_TABLE, table_uri
from rayline.tables import labels as labels_table
from rayline.tables.delta_tables import storage_options
from rayline.tables.prediction_reads import committed_nights, read_night

DRIFT_SATURATION = 4.0  # a class predicted this many times as often as in the reference scores 1
CSV_COLUMNS = ("uri", "etag", "label", "predicted_class", "confidence", "shadow_class", "priority", "why")


class QueueConfig(BaseModel):
    root: str
    model_name: str
    dt: str = Field(description="The night to choose from.")
    budget: int = Field(ge=1, description="Photos to queue, at most.")
    reference_counts: dict[str, int] = Field(default_factory=dict, description="Class counts to judge drift by.")
    weights: tuple[float, float, float] = Field(
        (0.5, 0.3, 0.2), description="Of uncertainty, disagreement and drift in a photo's priority."
    )


class QueuedPhoto(BaseModel):
    uri: str
    etag: str
    predicted_class: str
    confidence: float
    shadow_class: str | None
    uncertainty: float
    disagreement: float
    drift: float
    priority: float

    def why(self) -> str:
        parts = [f"uncertainty {self.uncertainty:.2f}", f"drift {self.drift:.2f}"]
        if self.disagreement:
            parts.insert(1, f"shadow said {self.shadow_class}")
        return ", ".join(parts)


class QueueResult(BaseModel):
    model_name: str
    dt: str
    candidates: int = Field(description="Predicted photos of the night not labelled yet.")
    already_labelled: int
    queued: list[QueuedPhoto]
    shadowed: bool = Field(description="Whether the night had a shadow version to disagree with.")
    label_studio_uri: str
    csv_uri: str
    predictions_table: str

    def lineage_inputs(self) -> list[DatasetRef]:
        return [DatasetRef(uri=self.predictions_table, facets={"model_name": self.model_name, "dt": self.dt})]

    def lineage_outputs(self) -> list[DatasetRef]:
        return [DatasetRef(uri=self.label_studio_uri), DatasetRef(uri=self.csv_uri)]


def uncertainty(top_k_prob: list[list[float]]) -> np.ndarray:
    """One minus the margin between each photo's two most probable classes (1 with a single class kept)."""
    first = np.array([p[0] if p else 0.0 for p in top_k_prob], dtype=np.float64)
    second = np.array([p[1] if len(p) > 1 else 0.0 for p in top_k_prob], dtype=np.float64)
    return np.clip(1.0 - (first - second), 0.0, 1.0)


def drift_scores(predicted: list[str], reference: Mapping[str, int]) -> np.ndarray:
    """Per photo: how much more often the night predicted its class than the reference (module docstring)."""
    if not predicted or not reference:
        return np.zeros(len(predicted))
    night, total = Counter(predicted), sum(reference.values())
    floor = 0.5 / max(total, 1)  # a class the reference never saw: half a photo's share
    score = {
        c: math.log((n / len(predicted)) / max(reference.get(c, 0) / total, floor)) / math.log(DRIFT_SATURATION)
        for c, n in night.items()
    }
    scores: np.ndarray = np.clip(np.array([score[c] for c in predicted]), 0.0, 1.0)
    return scores


def _shadow_classes(root: str, model_name: str, dt: str, uris: pa.Array) -> tuple[list[str | None], bool]:
    uri = table_uri(root, SHADOW_TABLE)
    if not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return [None] * len(uris), False
    rows = read_night(uri, model_name, dt)
    if rows.num_rows == 0:
        return [None] * len(uris), False
    by_uri = dict(zip(rows["uri"].to_pylist(), rows["predicted_class"].to_pylist(), strict=True))
    return [by_uri.get(u) for u in uris.to_pylist()], True


def choose(cfg: QueueConfig) -> tuple[list[QueuedPhoto], int, int, bool]:
    """The queued photos, the night's unlabelled photos, those already labelled, and whether it was shadowed."""
    night = read_night(table_uri(cfg.root, PREDICTIONS_TABLE), cfg.model_name, cfg.dt)
    if night.num_rows == 0 and cfg.dt not in committed_nights(cfg.root, cfg.model_name):
        latest = ", ".join(committed_nights(cfg.root, cfg.model_name, 5)) or "none"
        raise InputDataError(f"{cfg.model_name} has no committed night {cfg.dt} to choose from (its latest: {latest})")
    labelled = labels_table.read_labels(cfg.root, cfg.model_name)
    keys = pc.binary_join_element_wise(night["uri"], night["etag"], "\t")
    done = pc.binary_join_element_wise(labelled["uri"], labelled["etag"], "\t")
    fresh = night.filter(pc.invert(pc.is_in(keys, value_set=done)))
    shadow, shadowed = _shadow_classes(cfg.root, cfg.model_name, cfg.dt, fresh["uri"].combine_chunks())
    predicted = [str(c) for c in fresh["predicted_class"].to_pylist()]
    u = uncertainty(fresh["top_k_prob"].to_pylist())
    d = np.array([1.0 if s is not None and s != p else 0.0 for s, p in zip(shadow, predicted, strict=True)])
    r = drift_scores(predicted, cfg.reference_counts)
    wu, wd, wr = cfg.weights
    priority = wu * u + wd * d + wr * r
    uris, etags = fresh["uri"].to_pylist(), fresh["etag"].to_pylist()
    confidence = fresh["confidence"].to_pylist()
    order = sorted(range(fresh.num_rows), key=lambda i: (-priority[i], uris[i]))[: cfg.budget]
    queued = [
        QueuedPhoto(
            uri=uris[i],
            etag=etags[i],
            predicted_class=predicted[i],
            confidence=float(confidence[i]),
            shadow_class=shadow[i],
            uncertainty=float(u[i]),
            disagreement=float(d[i]),
            drift=float(r[i]),
            priority=float(priority[i]),
        )
        for i in order
    ]
    return queued, fresh.num_rows, night.num_rows - fresh.num_rows, shadowed


def label_studio_tasks(queued: list[QueuedPhoto], model: str) -> list[dict[str, object]]:
    """Label Studio's import format: one task per photo, the champion's answer as a pre-annotation."""
    return [
        {
            "data": {"image": q.uri, "uri": q.uri, "etag": q.etag, "priority": round(q.priority, 4), "why": q.why()},
            "predictions": [
                {
                    "model_version": model,
                    "score": round(q.confidence, 4),
                    "result": [
                        {
                            "from_name": "label",
                            "to_name": "image",
                            "type": "choices",
                            "value": {"choices": [q.predicted_class]},
                        }
                    ],
                }
            ],
        }
        for q in queued
    ]


def queue_csv(queued: list[QueuedPhoto]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for q in queued:
        writer.writerow(
            [q.uri, q.etag, "", q.predicted_class, f"{q.confidence:.4f}", q.shadow_class or "", f"{q.priority:.4f}",
             q.why()]
        )  # fmt: skip
    return out.getvalue().encode()


def run(cfg: QueueConfig) -> QueueResult:
    """Choose the night's photos to label and write the queue (replacing one written for the same night)."""
    queued, candidates, labelled, shadowed = choose(cfg)
    folder = storage.join(storage.normalize(cfg.root), LABEL_QUEUES_DIR, cfg.model_name, f"dt={cfg.dt}")
    tasks_uri, csv_uri = storage.join(folder, "label-studio.json"), storage.join(folder, "queue.csv")
    tasks = label_studio_tasks(queued, cfg.model_name)
    storage.write_bytes_atomic(tasks_uri, json.dumps(tasks, indent=1).encode())
    storage.write_bytes_atomic(csv_uri, queue_csv(queued))
    return QueueResult(
        model_name=cfg.model_name,
        dt=cfg.dt,
        candidates=candidates,
        already_labelled=labelled,
        queued=queued,
        shadowed=shadowed,
        label_studio_uri=tasks_uri,
        csv_uri=csv_uri,
        predictions_table=table_uri(cfg.root, PREDICTIONS_TABLE),
    )
