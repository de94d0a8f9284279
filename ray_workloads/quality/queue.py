"""What to label next: a night's photos ranked by how much a label would teach, within a budget, and a share
drawn at random so that the labels can also judge the versions without bias (docs/quality.md).

Each photo's priority is ``0.5 · uncertainty + 0.3 · disagreement + 0.2 · drift`` (``QueueConfig.weights``):
the photos the champion is most likely wrong on, which is what training wants and what a comparison of two
versions must not see (a challenger no better than the champion wins most of their disagreements there).
So ``random_share`` of the budget is drawn uniformly from the night's predicted photos, whatever their
answers, in a permutation seeded by the model and night (:class:`RandomDraw`, recorded beside the queue; a
larger budget takes a longer prefix of it). Only labels of drawn photos judge a challenger
(``rayline.ray_workloads.quality.evidence``). Photos labelled already (at the ETag predicted) are not
queued again. The queue is a Label Studio task file and a CSV whose ``label`` column, filled in, is what
``rayline labels import`` takes back; the drawn photos are spread evenly among the targeted ones, so a
team that labels from the top still labels its share of them.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from collections.abc import Mapping
from typing import Literal

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
CSV_COLUMNS = (
    "uri", "etag", "label", "predicted_class", "confidence", "shadow_class", "priority", "why", "selection",
    "inclusion_probability",
)  # fmt: skip
DRAWS_DIR = "random-draws"
Selection = Literal["random", "targeted"]


class QueueConfig(BaseModel):
    root: str
    model_name: str
    dt: str = Field(description="The night to choose from.")
    budget: int = Field(ge=1, description="Photos to queue, at most.")
    reference_counts: dict[str, int] = Field(default_factory=dict, description="Class counts to judge drift by.")
    weights: tuple[float, float, float] = Field((0.5, 0.3, 0.2), description="Of uncertainty, disagreement, drift.")
    random_share: float = Field(
        0.2, ge=0, le=1, description="Share of the budget drawn at random: the only labels the promotion gate counts."
    )

    @property
    def drawn(self) -> int:
        """How many of the night's photos the random share draws."""
        return round(self.budget * self.random_share)


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
    selection: Selection = Field(description="random: drawn whatever its answers; targeted: by its priority.")
    inclusion_probability: float = Field(description="Its chance of being queued: drawn / predicted, or 1.")

    def why(self) -> str:
        if self.selection == "random":
            return f"drawn at random ({self.inclusion_probability:.2%} of the night)"
        parts = [f"uncertainty {self.uncertainty:.2f}", f"drift {self.drift:.2f}"]
        if self.disagreement:
            parts.insert(1, f"shadow said {self.shadow_class}")
        return ", ".join(parts)


class RandomDraw(BaseModel):
    """The night's photos drawn uniformly at random, whatever their answers: what the promotion gate counts."""

    model_name: str
    dt: str
    population: int = Field(description="The night's predicted photos the draw was made from.")
    seed: int
    photos: list[tuple[str, str]] = Field(description="(URI, ETag) of each photo drawn.")

    @property
    def inclusion_probability(self) -> float:
        return len(self.photos) / self.population if self.population else 0.0


class QueueResult(BaseModel):
    model_name: str
    dt: str
    candidates: int = Field(description="Predicted photos of the night not labelled yet.")
    already_labelled: int
    queued: list[QueuedPhoto]
    shadowed: bool = Field(description="Whether the night had a shadow version to disagree with.")
    label_studio_uri: str
    csv_uri: str
    draw_uri: str = Field(description="The random draw's record (its photos may count for the promotion gate).")
    drawn: int = Field(description="Photos drawn at random (queued now, or labelled already).")
    predictions_table: str

    def lineage_inputs(self) -> list[DatasetRef]:
        return [DatasetRef(uri=self.predictions_table, facets={"model_name": self.model_name, "dt": self.dt})]

    def lineage_outputs(self) -> list[DatasetRef]:
        return [
            DatasetRef(uri=self.label_studio_uri, stored_as="json"),
            DatasetRef(uri=self.csv_uri, stored_as="csv"),
            DatasetRef(uri=self.draw_uri, stored_as="json"),
        ]


def uncertainty(top_k_prob: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One minus the margin between each photo's two most probable classes (1 with a single class kept)."""
    lists = top_k_prob.combine_chunks() if isinstance(top_k_prob, pa.ChunkedArray) else top_k_prob
    if len(lists) == 0:
        return np.zeros(0)
    values = np.asarray(lists.flatten().to_numpy(zero_copy_only=False), dtype=np.float64)
    offsets = np.asarray(lists.offsets.to_numpy())
    starts = offsets[:-1] - offsets[0]  # a slice's offsets index the whole values buffer; flatten() does not
    lengths = np.asarray(pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False))
    padded = np.append(values, [0.0, 0.0])  # reads past a short list's end land on zeros, then are masked
    first = np.where(lengths > 0, padded[starts], 0.0)
    second = np.where(lengths > 1, padded[np.minimum(starts + 1, len(padded) - 1)], 0.0)
    return np.clip(1.0 - (first - second), 0.0, 1.0)


def drift_scores(predicted: pa.Array, reference: Mapping[str, int]) -> np.ndarray:
    """Per photo: how much more often the night predicted its class than the reference (module docstring)."""
    if len(predicted) == 0 or not reference:
        return np.zeros(len(predicted))
    counts = pc.value_counts(predicted)
    classes, night = counts.field("values").to_pylist(), counts.field("counts").to_pylist()
    total = sum(reference.values())
    floor = 0.5 / max(total, 1)  # a class the reference never saw: half a photo's share
    score = [
        math.log((n / len(predicted)) / max(reference.get(c, 0) / total, floor)) / math.log(DRIFT_SATURATION)
        for c, n in zip(classes, night, strict=True)
    ]
    which = np.asarray(pc.index_in(predicted, value_set=pa.array(classes, predicted.type)).to_numpy())
    scores: np.ndarray = np.clip(np.asarray(score)[which], 0.0, 1.0)
    return scores


def _shadow_classes(root: str, model_name: str, dt: str, uris: pa.Array) -> tuple[pa.Array, bool]:
    """The class the night's shadow version predicted for each of ``uris`` (null where it has none)."""
    uri = table_uri(root, SHADOW_TABLE)
    rows = read_night(uri, model_name, dt) if DeltaTable.is_deltatable(uri, storage_options(uri)) else None
    if rows is None or rows.num_rows == 0:
        return pa.nulls(len(uris), pa.string()), False
    at = pc.index_in(uris, value_set=rows["uri"].combine_chunks())
    return rows["predicted_class"].combine_chunks().cast(pa.string()).take(at), True


def draw_seed(model_name: str, dt: str) -> int:
    """The seed of a night's random draw: fixed by the model and night, so queueing it again draws alike."""
    return int.from_bytes(hashlib.sha256(f"rayline-draw/{model_name}/{dt}".encode()).digest()[:8], "big")


def draw_order(population: int, seed: int) -> np.ndarray:
    """The night's photos (indices into its rows, sorted by URI and ETag) in the draw's order: a draw of ``k``
    is the first ``k``, so any budget's draw is uniform and a larger one holds a smaller one."""
    order: np.ndarray = np.random.default_rng(seed).permutation(population)
    return order


def priorities(
    night: pa.Table, shadow: pa.Array, reference: Mapping[str, int], weights: tuple[float, float, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each photo's (uncertainty, disagreement, drift, priority) (the module docstring); ``shadow``: the shadow
    version's class of each photo, null where it predicted none."""
    predicted = night["predicted_class"].combine_chunks().cast(pa.string())
    u = uncertainty(night["top_k_prob"])
    disagrees = pc.fill_null(pc.not_equal(shadow, predicted), False)
    d = np.asarray(disagrees.to_numpy(zero_copy_only=False), dtype=np.float64)
    r = drift_scores(predicted, reference)
    wu, wd, wr = weights
    return u, d, r, wu * u + wd * d + wr * r


def select(
    night: pa.Table, labelled: np.ndarray, shadow: pa.Array, cfg: QueueConfig
) -> tuple[list[QueuedPhoto], RandomDraw]:
    """The queue of ``night`` (rows sorted by URI and ETag; ``labelled``: a mask of those labelled already) and
    its random draw: the drawn photos not labelled yet, spread among the highest priorities of the rest."""
    n = night.num_rows
    seed = draw_seed(cfg.model_name, cfg.dt)
    drawn = draw_order(n, seed)[: min(cfg.drawn, n)]
    uris, etags = night["uri"].to_pylist(), night["etag"].to_pylist()
    draw = RandomDraw(
        model_name=cfg.model_name, dt=cfg.dt, population=n, seed=seed, photos=[(uris[i], etags[i]) for i in drawn]
    )
    in_draw = np.zeros(n, dtype=bool)
    in_draw[drawn] = True
    random_picks = [int(i) for i in drawn if not labelled[i]]
    u, d, r, priority = priorities(night, shadow, cfg.reference_counts, cfg.weights)
    eligible = np.flatnonzero(~labelled & ~in_draw)
    ranked = eligible[np.argsort(-priority[eligible], kind="stable")]  # rows are in URI order: ties by URI
    targeted = [int(i) for i in ranked[: max(cfg.budget - len(random_picks), 0)]]
    chosen = targeted + random_picks
    picked = night.select(["predicted_class", "confidence"]).take(chosen).to_pydict()
    shadows = shadow.take(chosen).to_pylist()

    def queued(k: int, selection: Selection) -> QueuedPhoto:
        i = chosen[k]
        return QueuedPhoto.model_construct(  # typed here already: a night's queue is built without revalidating
            uri=uris[i],
            etag=etags[i],
            predicted_class=str(picked["predicted_class"][k]),
            confidence=float(picked["confidence"][k]),
            shadow_class=shadows[k],
            uncertainty=float(u[i]),
            disagreement=float(d[i]),
            drift=float(r[i]),
            priority=float(priority[i]),
            selection=selection,
            inclusion_probability=draw.inclusion_probability if selection == "random" else 1.0,
        )

    drawn_picks = [queued(k, "random") for k in range(len(targeted), len(chosen))]
    return interleave([queued(k, "targeted") for k in range(len(targeted))], drawn_picks), draw


def interleave(targeted: list[QueuedPhoto], drawn: list[QueuedPhoto]) -> list[QueuedPhoto]:
    """The targeted photos in priority order with the drawn ones spread evenly among them."""
    total = len(targeted) + len(drawn)
    # (k + 1/2) · total / m apart by total / m ≥ 1: distinct positions, all before the end
    slots = {int((k + 0.5) * total / len(drawn)) for k in range(len(drawn))}
    t, r = iter(targeted), iter(drawn)
    return [next(r) if position in slots else next(t) for position in range(total)]


def choose(cfg: QueueConfig) -> tuple[list[QueuedPhoto], RandomDraw, int, int, bool]:
    """The queued photos, the draw, the night's unlabelled and labelled counts, and whether it was shadowed."""
    night = read_night(table_uri(cfg.root, PREDICTIONS_TABLE), cfg.model_name, cfg.dt)
    if night.num_rows == 0 and cfg.dt not in committed_nights(cfg.root, cfg.model_name):
        latest = ", ".join(committed_nights(cfg.root, cfg.model_name, 5)) or "none"
        raise InputDataError(f"{cfg.model_name} has no committed night {cfg.dt} to choose from (its latest: {latest})")
    night = night.sort_by([("uri", "ascending"), ("etag", "ascending")])
    labelled = labels_table.read_labels(cfg.root, cfg.model_name)
    keys = pc.binary_join_element_wise(night["uri"], night["etag"], "\t")
    done = pc.binary_join_element_wise(labelled["uri"], labelled["etag"], "\t")
    already = np.asarray(pc.is_in(keys, value_set=done).to_numpy(zero_copy_only=False), dtype=bool)
    shadow, shadowed = _shadow_classes(cfg.root, cfg.model_name, cfg.dt, night["uri"].combine_chunks())
    queued, draw = select(night, already, shadow, cfg)
    fresh = int((~already).sum())
    return queued, draw, fresh, night.num_rows - fresh, shadowed


def draw_uri(root: str, model_name: str, dt: str, drawn: int) -> str:
    """Where a draw of ``drawn`` photos of the night is recorded: one file per size, so two queues never race."""
    return storage.join(queue_folder(root, model_name, dt), DRAWS_DIR, f"{drawn:08d}.json")


def queue_folder(root: str, model_name: str, dt: str) -> str:
    return storage.join(storage.normalize(root), LABEL_QUEUES_DIR, model_name, f"dt={dt}")


def label_studio_tasks(queued: list[QueuedPhoto], model: str) -> list[dict[str, object]]:
    """Label Studio's import format: one task per photo, the champion's answer as a pre-annotation of a
    ``Choices`` control named ``label`` on an ``Image`` named ``image``."""
    return [{"data": _task_data(q), "predictions": [_pre_annotation(q, model)]} for q in queued]


def _task_data(q: QueuedPhoto) -> dict[str, object]:
    data = q.model_dump(include={"uri", "etag", "selection", "inclusion_probability"})
    return {"image": q.uri, **data, "priority": round(q.priority, 4), "why": q.why()}


def _pre_annotation(q: QueuedPhoto, model: str) -> dict[str, object]:
    choice = {"from_name": "label", "to_name": "image", "type": "choices", "value": {"choices": [q.predicted_class]}}
    return {"model_version": model, "score": round(q.confidence, 4), "result": [choice]}


def queue_csv(queued: list[QueuedPhoto]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for q in queued:
        writer.writerow(
            [q.uri, q.etag, "", q.predicted_class, f"{q.confidence:.4f}", q.shadow_class or "", f"{q.priority:.4f}",
             q.why(), q.selection, f"{q.inclusion_probability:.6g}"]
        )  # fmt: skip
    return out.getvalue().encode()


def run(cfg: QueueConfig) -> QueueResult:
    """Choose the night's photos to label and write the queue (replacing one written for the same night) and
    the record of its random draw (kept: the gate counts the labels of every draw)."""
    queued, draw, candidates, labelled, shadowed = choose(cfg)
    folder = queue_folder(cfg.root, cfg.model_name, cfg.dt)
    recorded = draw_uri(cfg.root, cfg.model_name, cfg.dt, len(draw.photos))
    if draw.photos:  # before the queue: a label must never come back for a drawn photo the gate cannot see
        storage.write_json_atomic(recorded, draw.model_dump(mode="json"))
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
        draw_uri=recorded,
        drawn=len(draw.photos),
        predictions_table=table_uri(cfg.root, PREDICTIONS_TABLE),
    )


def recorded_draws(root: str, model_name: str) -> list[RandomDraw]:
    """Every random draw recorded for the model's nights (each night's draws of each size)."""
    base = storage.join(storage.normalize(root), LABEL_QUEUES_DIR, model_name)
    folders = [storage.join(base, night, DRAWS_DIR) for night in storage.list_folders(base)]
    return [
        RandomDraw.model_validate(storage.read_json(storage.join(folder, name)))
        for folder in folders
        for name in storage.list_names(folder)
        if name.endswith(".json")
    ]
