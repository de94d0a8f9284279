"""Batch inference: every input object gets exactly one prediction row or one error row.

Ray Data streams the listing through a fetch+decode stage (concurrent reads,
per-sample error capture) into a pool of predictor actors (the model is
loaded once per actor), and a datasink writes predictions and errors under
a run folder of the partition. The run is then verified (predictions ∪ errors
== listed inputs, each once) and committed: ``manifest.json`` naming the
files, then ``_SUCCESS``. Readers go by the manifest, so they see the previous
committed run or this one, never a mix; a rerun replaces the manifest and then
removes the old run's files.

Layout::

    <output_root>/<partition>/run-<id>/predictions/part-*.parquet
    <output_root>/<partition>/run-<id>/errors/part-*.parquet
    <output_root>/<partition>/manifest.json    the commit point
    <output_root>/<partition>/_SUCCESS
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import torch
from pydantic import BaseModel, Field
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink, WriteResult

from ray_workloads.images import ImageDecodeError, ImageSpec, decode_image
from ray_workloads.ingest import content_hash
from ray_workloads.models import ModelSpec, load_model
from rayline import storage
from rayline.errors import InputDataError, StorageError
from rayline.registry import ModelVersion

MANIFEST = "manifest.json"
SUCCESS = "_SUCCESS"


class InferenceConfig(BaseModel):
    input_uri: str
    output_root: str
    partition: str = Field(description="Folder name of the output partition, e.g. dt=2026-11-28.")
    model: ModelVersion
    batch_size: int = Field(64, ge=1)
    actors: int = Field(2, ge=1)
    cpus_per_actor: float = Field(0.5, gt=0)
    gpus_per_actor: float = Field(0.0, ge=0)
    objects_per_task: int = Field(256, ge=1)
    io_concurrency: int = Field(64, ge=1)
    top_k: int = Field(3, ge=1)
    code_version: str = "unknown"
    flow_run_id: str | None = None


class InferenceResult(BaseModel):
    partition_uri: str
    manifest_uri: str
    run_id: str
    inputs: int
    predictions: int
    errors: int
    error_types: dict[str, int]
    input_content_hash: str
    model: str
    files: dict[str, list[str]]
    elapsed_s: float

    @property
    def error_fraction(self) -> float:
        return self.errors / self.inputs if self.inputs else 0.0

    @property
    def errors_uri(self) -> str:
        return storage.join(self.partition_uri, f"run-{self.run_id}", "errors")


def fetch_and_decode(batch: dict[str, np.ndarray], spec: ImageSpec, concurrency: int) -> dict[str, Any]:
    """Fetch a slice of the listing concurrently and decode each image; failures become error fields."""
    uris = [str(u) for u in batch["uri"]]
    fetched = storage.fetch_many(uris, concurrency)
    n = len(uris)
    images = np.zeros((n, 3, spec.size, spec.size), dtype=np.float32)
    stage: list[str | None] = [None] * n
    error_type: list[str | None] = [None] * n
    message: list[str | None] = [None] * n
    for i, item in enumerate(fetched):
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
        "uri": batch["uri"],
        "etag": batch["etag"],
        "image": images,
        # explicit: an all-null error column comes back from Arrow as NaNs, not Nones
        "decoded": np.array([t is None for t in error_type], dtype=bool),
        "stage": np.array(stage, dtype=object),
        "error_type": np.array(error_type, dtype=object),
        "error_message": np.array(message, dtype=object),
    }


class Predictor:
    """Actor-pool UDF: loads the model once, predicts the decoded rows of each batch."""

    def __init__(self, model: ModelVersion, top_k: int) -> None:
        torch.set_num_threads(1)
        self.model_ref = model
        self.top_k = min(top_k, len(model.classes))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(ModelSpec.model_validate(model.model_spec), model.weights_uri).to(self.device)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        n = len(batch["uri"])
        ok = np.asarray(batch["decoded"], dtype=bool).copy()
        predicted = np.full(n, -1, dtype=np.int64)
        confidence = np.zeros(n, dtype=np.float32)
        top_idx = np.full((n, self.top_k), -1, dtype=np.int64)
        top_p = np.zeros((n, self.top_k), dtype=np.float32)
        stage, error_type, message = list(batch["stage"]), list(batch["error_type"]), list(batch["error_message"])
        started = time.perf_counter()
        if ok.any():
            try:
                with torch.no_grad():
                    images = torch.from_numpy(np.ascontiguousarray(batch["image"][ok])).to(self.device)
                    probs = torch.softmax(self.model(images), dim=1).cpu()
                values, indices = probs.topk(self.top_k, dim=1)
                top_idx[ok], top_p[ok] = indices.numpy(), values.numpy()
                predicted[ok], confidence[ok] = top_idx[ok][:, 0], top_p[ok][:, 0]
            except Exception as exc:  # the batch failed as a whole: every sample in it is an error row
                for i in np.flatnonzero(ok):
                    stage[i], error_type[i], message[i] = "predict", type(exc).__name__, str(exc)[:500]
                ok[:] = False
        per_sample_ms = (time.perf_counter() - started) * 1000 / max(1, int(ok.sum()))
        names = np.array(self.model_ref.classes, dtype=object)
        return {
            "uri": batch["uri"],
            "etag": batch["etag"],
            "ok": ok,
            "predicted_index": predicted,
            "predicted_class": np.array([names[p] if p >= 0 else None for p in predicted], dtype=object),
            "confidence": confidence,
            "top_k_index": top_idx,
            "top_k_prob": top_p,
            "inference_ms": np.full(n, per_sample_ms, dtype=np.float32),
            "stage": np.array(stage, dtype=object),
            "error_type": np.array(error_type, dtype=object),
            "error_message": np.array(message, dtype=object),
        }


_PREDICTION_COLUMNS = [
    "uri",
    "etag",
    "predicted_index",
    "predicted_class",
    "confidence",
    "top_k_index",
    "top_k_prob",
    "inference_ms",
]
_ERROR_COLUMNS = ["uri", "stage", "error_type", "error_message"]


class PartitionRunSink(Datasink[dict[str, Any]]):
    """Writes each task's rows to ``predictions/`` and ``errors/`` of one run folder."""

    def __init__(self, run_uri: str, constants: dict[str, Any]) -> None:
        self.run_uri = run_uri
        self.constants = constants
        self.result: WriteResult[dict[str, Any]] | None = None

    def get_name(self) -> str:
        return "RaylinePartitionRun"

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        tables = [t for t in (BlockAccessor.for_block(b).to_arrow() for b in blocks) if t.num_rows]
        report: dict[str, Any] = {"files": {}, "error_types": {}}
        if not tables:
            return report
        table = pa.concat_tables(tables, promote_options="default")
        ok = np.asarray(table.column("ok").to_pylist(), dtype=bool)
        name = f"part-{ctx.task_idx:05d}-{uuid.uuid4().hex[:8]}.parquet"
        if ok.any():
            rows = table.filter(pa.array(ok)).select(_PREDICTION_COLUMNS)
            rows = _flatten_tensors(rows)
            for key, value in self.constants.items():
                rows = rows.append_column(key, pa.array([value] * rows.num_rows))
            uri = storage.join(self.run_uri, "predictions", name)
            storage.write_parquet_atomic(uri, rows)
            report["files"]["predictions"] = {"uri": uri, "rows": rows.num_rows}
        if (~ok).any():
            errors = table.filter(pa.array(~ok)).select(_ERROR_COLUMNS)
            uri = storage.join(self.run_uri, "errors", name)
            storage.write_parquet_atomic(uri, errors)
            report["files"]["errors"] = {"uri": uri, "rows": errors.num_rows}
            report["error_types"] = dict(Counter(errors.column("error_type").to_pylist()))
        return report

    def on_write_complete(self, write_result: WriteResult[dict[str, Any]]) -> None:
        self.result = write_result


def _flatten_tensors(table: pa.Table) -> pa.Table:
    """Tensor columns → plain list columns, so any Parquet reader understands them."""
    for name in ("top_k_index", "top_k_prob"):
        column = table.column(name).combine_chunks()
        values = column.to_numpy_ndarray() if hasattr(column, "to_numpy_ndarray") else np.asarray(column)
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(values.tolist()))
    return table


def _verify_exactly_once(files: dict[str, list[str]], expected: set[str]) -> None:
    seen: list[str] = []
    for kind in ("predictions", "errors"):
        if files.get(kind):
            seen.extend(storage.read_parquet(files[kind]).column("uri").to_pylist())
    duplicates = [u for u, c in Counter(seen).items() if c > 1]
    missing, extra = expected - set(seen), set(seen) - expected
    if duplicates or missing or extra:
        raise StorageError(
            f"refusing to commit: {len(missing)} inputs missing, {len(extra)} unexpected, "
            f"{len(duplicates)} duplicated (e.g. {(sorted(missing) + sorted(extra) + duplicates)[:3]})"
        )


def run(cfg: InferenceConfig) -> InferenceResult:
    """Predict every object under ``cfg.input_uri`` and commit the partition atomically."""
    started = time.perf_counter()
    source = storage.normalize(cfg.input_uri)
    objects = storage.list_objects(source)
    if not objects:
        raise InputDataError(f"no input objects under {source}")
    partition_uri = storage.join(storage.normalize(cfg.output_root), cfg.partition)
    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
    run_uri = storage.join(partition_uri, f"run-{run_id}")
    spec = ImageSpec.model_validate(cfg.model.image_spec)

    listing = ray.data.from_items(
        [{"uri": o.uri, "etag": o.etag} for o in objects],
        override_num_blocks=max(1, math.ceil(len(objects) / cfg.objects_per_task)),
    )
    decoded = listing.map_batches(
        functools.partial(fetch_and_decode, spec=spec, concurrency=cfg.io_concurrency),
        batch_size=cfg.objects_per_task,
        batch_format="numpy",
        num_cpus=0.25,
    )
    predicted = decoded.map_batches(
        Predictor,
        fn_constructor_kwargs={"model": cfg.model, "top_k": cfg.top_k},
        batch_size=cfg.batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=cfg.actors),
        num_cpus=cfg.cpus_per_actor,
        num_gpus=cfg.gpus_per_actor or None,
    )
    constants = {
        "model_name": cfg.model.name,
        "model_version": cfg.model.version,
        "code_version": cfg.code_version,
        "flow_run_id": cfg.flow_run_id or "",
    }
    sink = PartitionRunSink(run_uri, constants)
    predicted.write_datasink(sink, ray_remote_args={"num_cpus": 0.25})
    reports = list(sink.result.write_returns) if sink.result else []
    files: dict[str, list[str]] = {"predictions": [], "errors": []}
    counts: Counter[str] = Counter()
    error_types: Counter[str] = Counter()
    for report in reports:
        for kind, info in report["files"].items():
            files[kind].append(info["uri"])
            counts[kind] += info["rows"]
        error_types.update(report["error_types"])
    _verify_exactly_once(files, {o.uri for o in objects})

    manifest = {
        "kind": "rayline.predictions",
        "partition": cfg.partition,
        "run_id": run_id,
        "input_uri": source,
        "input_content_hash": content_hash(objects),
        "inputs": len(objects),
        "predictions": counts["predictions"],
        "errors": counts["errors"],
        "error_types": dict(sorted(error_types.items())),
        "model": {"name": cfg.model.name, "version": cfg.model.version, "weights_uri": cfg.model.weights_uri},
        "code_version": cfg.code_version,
        "flow_run_id": cfg.flow_run_id,
        "files": {k: sorted(v) for k, v in files.items()},
        "committed_at": datetime.now(UTC).isoformat(),
    }
    manifest_uri = storage.join(partition_uri, MANIFEST)
    storage.write_json_atomic(manifest_uri, manifest)  # the switch: readers now see this run
    storage.write_bytes_atomic(storage.join(partition_uri, SUCCESS), f"{run_id}\n".encode())
    _remove_other_runs(partition_uri, keep=run_id)
    return InferenceResult(
        partition_uri=partition_uri,
        manifest_uri=manifest_uri,
        run_id=run_id,
        inputs=len(objects),
        predictions=counts["predictions"],
        errors=counts["errors"],
        error_types=dict(error_types),
        input_content_hash=manifest["input_content_hash"],
        model=f"{cfg.model.name} v{cfg.model.version}",
        files=manifest["files"],
        elapsed_s=time.perf_counter() - started,
    )


def _remove_other_runs(partition_uri: str, keep: str) -> None:
    """After the switch: drop the replaced run and leftovers of crashed ones."""
    fs, path = storage.filesystem(partition_uri)
    for entry in fs.ls(path, detail=False):
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("run-") and name != f"run-{keep}":
            storage.remove_tree(storage.join(partition_uri, name))


def read_partition(partition_uri: str) -> tuple[pa.Table, pa.Table]:
    """(predictions, errors) of the committed run of a partition, by its manifest."""
    manifest_uri = storage.join(partition_uri, MANIFEST)
    if not storage.exists(manifest_uri):
        raise InputDataError(f"{partition_uri} has no committed predictions (no {MANIFEST})")
    manifest = storage.read_json(manifest_uri)
    return storage.read_parquet(manifest["files"]["predictions"]), storage.read_parquet(manifest["files"]["errors"])
