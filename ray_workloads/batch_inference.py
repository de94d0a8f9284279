"""Batch inference: every input object gets exactly one prediction row or one error row.

The listing is cut into blocks and handed to a pool of predictor actors. An
actor loads the model once; for each block it fetches the objects
concurrently, decodes them one by one (a bad image becomes an error row, not a
failed job), predicts the decoded ones in batches and writes the block's
predictions and errors as Parquet under a run folder of the partition, then
reports the files it wrote. The run is then verified (predictions ∪ errors ==
listed inputs, each once) and committed: ``manifest.json`` naming the
reported files, then ``_SUCCESS``. Readers go by the manifest, so they see the
previous committed run or this one, never a mix (nor a file of a killed,
retried attempt); a rerun replaces the manifest and then removes the old
run's files.

Why plain Ray actors rather than a Ray Data pipeline: the inputs are URIs and
the outputs a few file names, so there is nothing for Ray Data to stream,
while on a small node a night's fixed cost (worker processes starting and
importing) weighs as much as its throughput. The Ray Data version started
processes per stage (fetch tasks, write tasks), imported ``ray.data`` in each
and started its own helper actors: ~7 s before the first row on 2 idle cores,
~12 s on busy ones. Here one actor call does a whole block, a small input
gets no more actors than it has blocks, the first actor starts while the
prefix is listed, and a process that asks for ``WORKER_PRELOAD`` gets actors
that already have torch. A killed actor is restarted by Ray and its block
retried. ``bench/batch_inference.py`` measures it against a plain loop.

Layout::

    <output_root>/<partition>/run-<id>/predictions/part-*.parquet
    <output_root>/<partition>/run-<id>/errors/part-*.parquet
    <output_root>/<partition>/manifest.json    the commit point
    <output_root>/<partition>/_SUCCESS
"""

from __future__ import annotations

import time
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
from pydantic import BaseModel, Field

from ray_workloads.images import ImageDecodeError, ImageSpec, decode_image
from ray_workloads.ingest import content_hash
from rayline import storage
from rayline.errors import ClusterError, InputDataError, RaylineError, StorageError
from rayline.registry import ModelVersion

if TYPE_CHECKING:
    from torch import nn

MANIFEST = "manifest.json"
SUCCESS = "_SUCCESS"
# Blocks queued on each actor: the next one is already there when a call ends.
_BLOCKS_IN_FLIGHT_PER_ACTOR = 2
# A lost actor (OOM, node loss, killed) is restarted and its blocks retried;
# an input that kills its actor every time fails the run after this many.
_ACTOR_RESTARTS = 3
# What a process that runs batch inference asks its embedded Ray cluster to
# import in every worker at start (``ray_cluster.connect(preload=...)``): the
# predictor actors then skip the torch import, most of their start-up.
WORKER_PRELOAD = ("torch",)


class InferenceConfig(BaseModel):
    input_uri: str
    output_root: str
    partition: str = Field(description="Folder name of the output partition, e.g. dt=2026-11-28.")
    model: ModelVersion
    batch_size: int = Field(64, ge=1, description="Images per model call.")
    actors: int = Field(2, ge=1)
    cpus_per_actor: float = Field(0.5, gt=0)
    gpus_per_actor: float = Field(0.0, ge=0)
    objects_per_task: int = Field(256, ge=1, description="Objects per actor call; each call writes one file.")
    io_concurrency: int = Field(64, ge=1, description="Concurrent object reads per actor call.")
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
    phase_s: dict[str, float] = Field(default_factory=dict, description="Wall-clock seconds per phase of the run.")

    @property
    def error_fraction(self) -> float:
        return self.errors / self.inputs if self.inputs else 0.0

    @property
    def errors_uri(self) -> str:
        return storage.join(self.partition_uri, f"run-{self.run_id}", "errors")


@dataclass(frozen=True)
class Block:
    """A slice of the listing: what one actor call fetches, predicts and writes."""

    uris: list[str]
    etags: list[str]


@dataclass(frozen=True)
class WrittenFile:
    """One Parquet file an actor call wrote, as reported to the driver."""

    kind: str  # "predictions" or "errors"
    uri: str
    rows: int
    error_types: dict[str, int] = field(default_factory=dict)


def _read_local(path: str) -> storage.Fetched:
    try:
        with open(path, "rb") as handle:
            return storage.Fetched(data=handle.read())
    except Exception as exc:
        return storage.Fetched(data=None, error=exc)


def fetch(uris: list[str], concurrency: int) -> list[storage.Fetched]:
    """The objects' bytes in order; a failed read is returned, not raised.

    S3 objects are fetched concurrently (latency is per request). Local files
    are read one after another: from the page cache each read takes ~15 µs,
    less than handing it to a thread pool costs (~80 µs of CPU).
    """
    if any(storage.is_s3(u) for u in uris):
        return storage.fetch_many(uris, concurrency)
    return [_read_local(u) for u in uris]


def fetch_and_decode(uris: list[str], spec: ImageSpec, concurrency: int) -> dict[str, np.ndarray]:
    """Fetch the objects and decode each image; failures become error fields, not exceptions."""
    fetched = fetch(uris, concurrency)
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
        "image": images,
        "ok": np.array([t is None for t in error_type], dtype=bool),
        "stage": np.array(stage, dtype=object),
        "error_type": np.array(error_type, dtype=object),
        "error_message": np.array(message, dtype=object),
    }


def prepare_for_inference(model: nn.Module) -> nn.Module:
    """The same model (same weights, outputs equal to ~1e-7), cheaper to run for inference.

    Batch norms are folded into the convolutions before them and the weights
    go channels-last, the layout of oneDNN's fast CPU convolutions. Measured
    on this project's 2-core machines: ~3.5x fewer CPU seconds per image for
    ``small_cnn``, about the same for resnet18 and mobilenet_v3_small at
    32 px. Feed it channels-last input. A model that cannot be traced is only
    re-laid out.
    """
    import torch
    from torch.fx.experimental.optimization import fuse

    try:
        model = fuse(model)  # eval mode only: folds running statistics into the conv weights
    except Exception:  # e.g. data-dependent control flow; folding is an optimisation, not a requirement
        pass
    return model.to(memory_format=torch.channels_last)


class Predictor:
    """Actor: loads the model once; each call handles one block end to end and reports its files."""

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

        from ray_workloads.models import ModelSpec, load_model

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
            loaded = load_model(ModelSpec.model_validate(model.model_spec), model.weights_uri)
            self.model = prepare_for_inference(loaded.to(self.device))
        except Exception as exc:
            # raised by each call instead: an actor whose __init__ fails tells the driver only that it
            # died (which reads as transient), not that the checkpoint is bad
            self.load_error = exc

    def run_block(self, block: Block) -> list[WrittenFile]:
        if self.load_error is not None:
            raise self.load_error
        rows = fetch_and_decode(block.uris, self.spec, self.io_concurrency)
        rows["uri"] = np.array(block.uris, dtype=object)
        rows["etag"] = np.array(block.etags, dtype=object)
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


_ERROR_COLUMNS = ["uri", "stage", "error_type", "error_message"]


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


def _blocks(objects: list[storage.ObjectInfo], size: int) -> list[Block]:
    return [
        Block([o.uri for o in objects[i : i + size]], [o.etag for o in objects[i : i + size]])
        for i in range(0, len(objects), size)
    ]


class _PredictorPool:
    """The predictor actors of one run: started ahead of need, killed when the run ends, however it ends."""

    def __init__(self, cfg: InferenceConfig, run_uri: str) -> None:
        self.cfg = cfg
        self.actor_class = ray.remote(Predictor).options(
            num_cpus=cfg.cpus_per_actor,
            num_gpus=cfg.gpus_per_actor,
            max_restarts=_ACTOR_RESTARTS,
            max_task_retries=_ACTOR_RESTARTS,
        )
        self.args = (cfg.model, cfg.top_k, cfg.batch_size, cfg.io_concurrency, run_uri, _constants(cfg))
        self.actors: list[Any] = []

    def __enter__(self) -> _PredictorPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for actor in self.actors:
            ray.kill(actor)

    def grow(self, size: int) -> None:
        """Start actors (asynchronously: each is a process that imports torch) until there are ``size``."""
        while len(self.actors) < size:
            self.actors.append(self.actor_class.remote(*self.args))

    def run(self, blocks: list[Block]) -> list[WrittenFile]:
        # a small night needs no more actors than it has blocks: each costs a process and a torch import
        self.grow(min(self.cfg.actors, len(blocks)))
        return _dispatch(self.actors, blocks)


def _constants(cfg: InferenceConfig) -> dict[str, Any]:
    """Columns with one value per run, added to every prediction row."""
    return {
        "model_name": cfg.model.name,
        "model_version": cfg.model.version,
        "code_version": cfg.code_version,
        "flow_run_id": cfg.flow_run_id or "",
    }


def _dispatch(actors: list[Any], blocks: list[Block]) -> list[WrittenFile]:
    """Keep every actor fed with up to ``_BLOCKS_IN_FLIGHT_PER_ACTOR`` blocks until all are done."""
    todo = deque(blocks)
    running: dict[Any, Any] = {}  # call ref -> actor

    def feed(actor: Any) -> None:
        if todo:
            running[actor.run_block.remote(todo.popleft())] = actor

    for actor in actors:
        for _ in range(_BLOCKS_IN_FLIGHT_PER_ACTOR):
            feed(actor)
    written: list[WrittenFile] = []
    while running:
        [ref], _ = ray.wait(list(running), num_returns=1)
        actor = running.pop(ref)
        written.extend(_result(ref))
        feed(actor)
    return written


def _result(ref: Any) -> list[WrittenFile]:
    """``ray.get`` of one actor call, surfacing rayline's own errors as themselves."""
    try:
        return list(ray.get(ref))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, RaylineError):
            raise exc.cause from exc
        raise
    except ray.exceptions.RayActorError as exc:
        raise ClusterError(f"a predictor actor was lost more than {_ACTOR_RESTARTS} times: {exc}") from exc


def _read_uris(uris: list[str]) -> list[str]:
    """The ``uri`` column of the written files, read concurrently (the other columns are not needed)."""

    def read(uri: str) -> list[str]:
        fs, path = storage.arrow_filesystem(uri)
        try:
            return [str(u) for u in pq.read_table(path, columns=["uri"], filesystem=fs).column("uri").to_pylist()]
        except Exception as exc:
            raise StorageError(f"reading back {uri}: {type(exc).__name__}: {exc}") from exc

    with ThreadPoolExecutor(8) as pool:
        return [u for part in pool.map(read, uris) for u in part]


def _verify_exactly_once(files: dict[str, list[str]], expected: set[str]) -> None:
    seen = _read_uris(files["predictions"] + files["errors"])
    duplicates = [u for u, c in Counter(seen).items() if c > 1]
    missing, extra = expected - set(seen), set(seen) - expected
    if duplicates or missing or extra:
        raise StorageError(
            f"refusing to commit: {len(missing)} inputs missing, {len(extra)} unexpected, "
            f"{len(duplicates)} duplicated (e.g. {(sorted(missing) + sorted(extra) + duplicates)[:3]})"
        )


class _Phases:
    """Wall-clock seconds per named phase (where a run's time goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 3)
        self._last = now


def run(cfg: InferenceConfig) -> InferenceResult:
    """Predict every object under ``cfg.input_uri`` and commit the partition atomically."""
    started = time.perf_counter()
    phases = _Phases()
    source = storage.normalize(cfg.input_uri)
    partition_uri = storage.join(storage.normalize(cfg.output_root), cfg.partition)
    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
    with _PredictorPool(cfg, storage.join(partition_uri, f"run-{run_id}")) as pool:
        pool.grow(1)  # every run needs one: its start-up overlaps the listing
        objects = storage.list_objects(source)
        if not objects:
            raise InputDataError(f"no input objects under {source}")
        phases.lap("list")
        written = pool.run(_blocks(objects, cfg.objects_per_task))
    phases.lap("predict_and_write")
    files: dict[str, list[str]] = {"predictions": [], "errors": []}
    counts: Counter[str] = Counter()
    error_types: Counter[str] = Counter()
    for item in written:
        files[item.kind].append(item.uri)
        counts[item.kind] += item.rows
        error_types.update(item.error_types)
    _verify_exactly_once(files, {o.uri for o in objects})
    phases.lap("verify")

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
    phases.lap("commit")
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
        phase_s=phases.seconds,
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
