"""The Ray Data UDF of batch inference: one call takes one block of the listing from URIs to Parquet.

:class:`PredictorUDF` runs in an actor pool (``map_batches(compute=
ActorPoolStrategy(...))``) and loads the model once per actor. Each input row
is a block (URIs and ETags); for it the actor fetches the objects
concurrently, decodes them one by one (a bad image becomes an error row, not a
failed job), predicts the decoded ones ``batch_size`` at a time and writes the
block's predictions and errors as Parquet under the run folder. It returns
only a report of the files it wrote: images never enter the object store.

torch is imported inside the actors only; the driver imports this module
without it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ray_workloads.images import ImageDecodeError, ImageSpec, decode_image
from rayline import storage
from rayline.registry import ModelVersion

if TYPE_CHECKING:
    from torch import nn

# Columns of the input dataset (one row per block) and of the reports the UDF returns.
BLOCK_COLUMNS = ("uris", "etags")
REPORT_COLUMNS = ("kind", "uri", "rows", "error_types")
_ERROR_COLUMNS = ["uri", "stage", "error_type", "error_message"]


@dataclass(frozen=True)
class WrittenFile:
    """One Parquet file a UDF call wrote, as reported to the driver."""

    kind: str  # "predictions" or "errors"
    uri: str
    rows: int
    error_types: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_report(cls, row: dict[str, Any]) -> WrittenFile:
        return cls(str(row["kind"]), str(row["uri"]), int(row["rows"]), json.loads(row["error_types"]))


def reports(written: list[WrittenFile]) -> dict[str, np.ndarray]:
    """The written files as a (tiny) output batch of the UDF."""
    return {
        "kind": np.array([w.kind for w in written], dtype=object),
        "uri": np.array([w.uri for w in written], dtype=object),
        "rows": np.array([w.rows for w in written], dtype=np.int64),
        "error_types": np.array([json.dumps(w.error_types) for w in written], dtype=object),
    }


def fetch_and_decode(uris: list[str], spec: ImageSpec, concurrency: int) -> dict[str, np.ndarray]:
    """Fetch the objects and decode each image; failures become error fields, not exceptions."""
    n = len(uris)
    images = np.zeros((n, 3, spec.size, spec.size), dtype=np.float32)
    stage: list[str | None] = [None] * n
    error_type: list[str | None] = [None] * n
    message: list[str | None] = [None] * n
    for i, item in enumerate(storage.fetch_many(uris, concurrency)):
        if item.error is not None:
            stage[i], error_type[i], message[i] = "fetch", type(item.error).__name__, str(item.error)[:500]
            continue
        try:
            images[i] = decode_image(item.data, spec)
        except ImageDecodeError as exc:
            stage[i], error_type[i], message[i] = "decode", type(exc).__name__, str(exc)[:500]
        except Exception as exc:  # one bad sample, whatever the decoder raised
            stage[i], error_type[i], message[i] = "decode", type(exc).__name__, str(exc)[:500]
    return {
        "image": images,
        "ok": np.array([t is None for t in error_type], dtype=bool),
        "stage": np.array(stage, dtype=object),
        "error_type": np.array(error_type, dtype=object),
        "error_message": np.array(message, dtype=object),
    }


class PredictorUDF:
    """Callable class for ``map_batches``: the model is loaded once per actor; a call writes whole blocks."""

    def __init__(
        self,
        model: ModelVersion,
        top_k: int,
        batch_size: int,
        io_concurrency: int,
        run_uri: str,
        constants: dict[str, Any],
    ) -> None:
        import torch  # here, not at module level: only the actors need it

        torch.set_num_threads(1)
        self.spec = ImageSpec.model_validate(model.image_spec)
        self.top_k = min(top_k, len(model.classes))
        self.names = np.array(model.classes, dtype=object)
        self.batch_size = batch_size
        self.io_concurrency = io_concurrency
        self.run_uri = run_uri
        self.constants = constants
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.load_error: Exception | None = None
        try:
            self.model = _load_for_inference(model, self.device)
        except Exception as exc:
            # raised by each call instead: an actor whose __init__ fails tells the driver only that it
            # died (which reads as transient), not that the checkpoint is bad
            self.load_error = exc

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        if self.load_error is not None:
            raise self.load_error
        uris, etags = (batch.column(name).to_pylist() for name in BLOCK_COLUMNS)
        written = [file for block in zip(uris, etags, strict=True) for file in self.run_block(*block)]
        return reports(written)

    def run_block(self, uris: list[str], etags: list[str]) -> list[WrittenFile]:
        rows = fetch_and_decode(uris, self.spec, self.io_concurrency)
        rows["uri"] = np.array(uris, dtype=object)
        rows["etag"] = np.array(etags, dtype=object)
        self.predict(rows)
        return write_block(rows, self.run_uri, self.constants)

    def predict(self, rows: dict[str, np.ndarray]) -> None:
        """Add top-k predictions to the decoded rows, ``batch_size`` images per model call.

        A model call that fails turns its rows into ``predict`` errors.
        """
        n, ok = len(rows["ok"]), rows["ok"]
        rows["predicted_index"] = np.full(n, -1, dtype=np.int64)
        rows["confidence"] = np.zeros(n, dtype=np.float32)
        rows["top_k_index"] = np.full((n, self.top_k), -1, dtype=np.int64)
        rows["top_k_prob"] = np.zeros((n, self.top_k), dtype=np.float32)
        rows["inference_ms"] = np.zeros(n, dtype=np.float32)
        decoded = np.flatnonzero(ok)
        for start in range(0, len(decoded), self.batch_size):
            batch = decoded[start : start + self.batch_size]
            try:
                self._predict_batch(rows, batch)
            except Exception as exc:  # the model call failed as a whole: each of its samples is an error row
                ok[batch] = False
                rows["stage"][batch], rows["error_type"][batch] = "predict", type(exc).__name__
                rows["error_message"][batch] = str(exc)[:500]
        names = [self.names[p] if p >= 0 else None for p in rows["predicted_index"]]
        rows["predicted_class"] = np.array(names, dtype=object)

    def _predict_batch(self, rows: dict[str, np.ndarray], batch: np.ndarray) -> None:
        import torch

        started = time.perf_counter()
        with torch.no_grad():
            images = torch.from_numpy(rows["image"][batch]).to(self.device)
            logits = self.model(images.contiguous(memory_format=torch.channels_last))
            values, indices = torch.softmax(logits, dim=1).topk(self.top_k, dim=1)
        rows["top_k_index"][batch], rows["top_k_prob"][batch] = indices.cpu().numpy(), values.cpu().numpy()
        rows["predicted_index"][batch] = rows["top_k_index"][batch, 0]
        rows["confidence"][batch] = rows["top_k_prob"][batch, 0]
        rows["inference_ms"][batch] = (time.perf_counter() - started) * 1000 / len(batch)


def _load_for_inference(model: ModelVersion, device: Any) -> nn.Module:
    from ray_workloads.models import ModelSpec, load_model, prepare_for_inference

    loaded = load_model(ModelSpec.model_validate(model.model_spec), model.weights_uri)
    return prepare_for_inference(loaded.to(device))


def _prediction_table(rows: dict[str, np.ndarray], selected: np.ndarray, constants: dict[str, Any]) -> pa.Table:
    n = int(selected.sum())
    columns: dict[str, pa.Array] = {
        "uri": pa.array(rows["uri"][selected].tolist(), pa.string()),
        "etag": pa.array(rows["etag"][selected].tolist(), pa.string()),
        "predicted_index": pa.array(rows["predicted_index"][selected]),
        "predicted_class": pa.array(rows["predicted_class"][selected].tolist(), pa.string()),
        "confidence": pa.array(rows["confidence"][selected]),
        # plain list columns (not tensors), so any Parquet reader understands them
        "top_k_index": pa.array(rows["top_k_index"][selected].tolist(), pa.list_(pa.int64())),
        "top_k_prob": pa.array(rows["top_k_prob"][selected].tolist(), pa.list_(pa.float64())),
        "inference_ms": pa.array(rows["inference_ms"][selected]),
    }
    columns.update({key: pa.array([value] * n) for key, value in constants.items()})
    return pa.table(columns)


def _error_table(rows: dict[str, np.ndarray], selected: np.ndarray) -> pa.Table:
    return pa.table({name: pa.array(rows[name][selected].tolist(), pa.string()) for name in _ERROR_COLUMNS})


def write_block(rows: dict[str, np.ndarray], run_uri: str, constants: dict[str, Any]) -> list[WrittenFile]:
    """Write a block's predictions and errors, one Parquet file each (when not empty)."""
    ok = rows["ok"]
    name = f"part-{uuid.uuid4().hex[:16]}.parquet"  # unique per attempt: a retried block never overwrites
    written = []
    if ok.any():
        uri = storage.join(run_uri, "predictions", name)
        storage.write_parquet_atomic(uri, table := _prediction_table(rows, ok, constants))
        written.append(WrittenFile("predictions", uri, table.num_rows))
    if (~ok).any():
        uri = storage.join(run_uri, "errors", name)
        storage.write_parquet_atomic(uri, table := _error_table(rows, ~ok))
        types = Counter(str(t) for t in table.column("error_type").to_pylist())
        written.append(WrittenFile("errors", uri, table.num_rows, dict(types)))
    return written
