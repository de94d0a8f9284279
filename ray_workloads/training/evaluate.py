"""Evaluation on a held-out split: accuracy, per-class precision/recall, confusion matrix, plots, and the
answers image by image (``rayline.models.split_answers``) that the promotion gate pairs with the champion's.
Predictions stream through Ray Data; the metrics are plain numpy, checked in isolation.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, Field

from rayline import storage
from rayline.lineage import DatasetRef
from rayline.models import split_answers
from rayline.ray_workloads.architectures.build import ModelSpec
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.execution.interface import LoadedModel, load
from rayline.ray_workloads.training.train import dataset_for_split


class ClassMetrics(BaseModel):
    name: str
    precision: float
    recall: float
    support: int


class EvaluationResult(BaseModel):
    split: str
    data_manifest_uri: str
    weights_uri: str
    samples: int
    accuracy: float
    per_class: list[ClassMetrics]
    confusion: list[list[int]]
    report_uri: str | None = None
    confusion_png_uri: str | None = None
    answers_uri: str | None = Field(None, description="Its answers on the split, image by image (Parquet).")

    def lineage_inputs(self) -> list[DatasetRef]:
        return [DatasetRef(uri=self.weights_uri), DatasetRef(uri=self.data_manifest_uri, stored_as="manifest")]

    def lineage_outputs(self) -> list[DatasetRef]:
        refs = []
        if self.report_uri:
            refs.append(DatasetRef(uri=self.report_uri, facets={"accuracy": self.accuracy}, stored_as="json"))
        if self.answers_uri:
            refs.append(DatasetRef(uri=self.answers_uri, facets={"images": self.samples}, stored_as="parquet"))
        return refs


def classification_metrics(
    y_true: np.ndarray, y_pred: np.ndarray, classes: Sequence[str]
) -> tuple[float, list[ClassMetrics], np.ndarray]:
    """Accuracy, per-class precision/recall and the confusion matrix (rows: truth)."""
    k = len(classes)
    confusion = np.zeros((k, k), dtype=np.int64)
    np.add.at(confusion, (y_true, y_pred), 1)
    predicted, actual, diagonal = confusion.sum(axis=0), confusion.sum(axis=1), np.diag(confusion)
    per_class = [
        ClassMetrics(
            name=name,
            precision=float(diagonal[i] / predicted[i]) if predicted[i] else 0.0,
            recall=float(diagonal[i] / actual[i]) if actual[i] else 0.0,
            support=int(actual[i]),
        )
        for i, name in enumerate(classes)
    ]
    accuracy = float(diagonal.sum() / max(1, confusion.sum()))
    return accuracy, per_class, confusion


def predict_split(model: LoadedModel, prepared: preprocess.PreprocessResult, split: str) -> pa.Table:
    """The answers on every row of ``split``, through the one model interface: each row keeps its image's
    (key, etag), so two versions' answers are matched image by image whatever order Ray Data read them in."""
    columns = ("key", "etag", "image", "label_index")
    parts = []
    for batch in dataset_for_split(prepared, split, columns).iter_batches(batch_size=512, batch_format="numpy"):
        predicted = model.logits(np.asarray(batch["image"], dtype=np.float32)).argmax(axis=1)
        parts.append(split_answers.answers_table(batch["key"], batch["etag"], batch["label_index"], predicted))
    return pa.concat_tables(parts)


def split_answers_of(spec: ModelSpec, weights_uri: str, data_manifest_uri: str, split: str = "test") -> pa.Table:
    """The answers of saved weights on ``split``, image by image."""
    prepared = preprocess.read_manifest(data_manifest_uri)
    return predict_split(_loaded(spec, weights_uri, prepared), prepared, split)


def _loaded(spec: ModelSpec, weights_uri: str, prepared: preprocess.PreprocessResult) -> LoadedModel:
    return load(spec.model_copy(update={"num_classes": len(prepared.classes)}), weights_uri, device=torch.device("cpu"))


def confusion_png(confusion: np.ndarray, classes: Sequence[str], title: str) -> bytes:
    fig, ax = _pyplot().subplots(figsize=(5, 4.5), dpi=100)
    ax.imshow(confusion, cmap="Blues")
    ax.set_xticks(range(len(classes)), classes)
    ax.set_yticks(range(len(classes)), classes)
    ax.set(xlabel="predicted", ylabel="true", title=title)
    for (i, j), value in np.ndenumerate(confusion):
        if value:
            colour = "white" if value > confusion.max() / 2 else "black"
            ax.text(j, i, str(value), ha="center", va="center", fontsize=7, color=colour)
    fig.tight_layout()
    return _png(fig)


def curves_png(series: Mapping[str, Sequence[tuple[float, float]]], ylabel: str, title: str) -> bytes:
    """Line plot of named (x, y) series: training curves, Tune trial curves."""
    fig, ax = _pyplot().subplots(figsize=(6, 4), dpi=100)
    for name, points in series.items():
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ax.set(xlabel="epoch", ylabel=ylabel, title=title)
    if len(series) <= 12:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    _pyplot().close(fig)
    return buffer.getvalue()


def run(
    spec: ModelSpec, weights_uri: str, data_manifest_uri: str, output_uri: str | None = None, split: str = "test"
) -> EvaluationResult:
    """Evaluate saved weights on ``split``; with ``output_uri``, also write JSON, a PNG and the answers there."""
    prepared = preprocess.read_manifest(data_manifest_uri)
    answers = predict_split(_loaded(spec, weights_uri, prepared), prepared, split)
    y_true, y_pred = answers.column("label_index").to_numpy(), answers.column("predicted_index").to_numpy()
    accuracy, per_class, confusion = classification_metrics(y_true, y_pred, prepared.classes)
    result = EvaluationResult(
        split=split,
        data_manifest_uri=data_manifest_uri,
        weights_uri=weights_uri,
        samples=int(len(y_true)),
        accuracy=accuracy,
        per_class=per_class,
        confusion=confusion.tolist(),
    )
    if output_uri:
        result.report_uri = storage.join(output_uri, f"evaluation-{split}.json")
        result.confusion_png_uri = storage.join(output_uri, f"confusion-{split}.png")
        result.answers_uri = storage.join(output_uri, f"answers-{split}.parquet")
        storage.write_parquet_atomic(result.answers_uri, answers)
        png = confusion_png(confusion, prepared.classes, f"{split}: accuracy {accuracy:.3f}")
        storage.write_bytes_atomic(result.confusion_png_uri, png)
        storage.write_json_atomic(result.report_uri, result.model_dump(mode="json"))
    return result
