"""Batch inference: every input object gets exactly one prediction row or one error row.

The listing is cut into blocks of ``objects_per_task`` URIs. A Ray Data
dataset holds one row per block, and one ``map_batches`` stage runs
:class:`~ray_workloads.inference_predictor.PredictorUDF` over it in an actor
pool: an actor loads the model once, then for each block fetches, decodes,
predicts and writes the block's predictions and errors as Parquet under a run
folder of the partition, and returns a report of the files it wrote. The
driver collects the reports, verifies the run (predictions ∪ errors == listed
inputs, each once) and commits it: ``manifest.json`` naming the reported
files, then ``_SUCCESS``. Readers go by the manifest, so they see the previous
committed run or this one, never a mix (nor a file of a killed, retried
attempt); a rerun replaces the manifest and then removes the old run's files.

Why Ray Data, and why one stage of whole blocks: Ray Data gives the actor
pool, its scheduling, and the restart of a lost actor with the retry of its
block (bounded here: ``_ACTOR_RESTARTS``). The inputs are URIs and the outputs
a few file names, so only those cross the object store, never images. An
earlier version with separate fetch, predict and write stages streamed the
images through the object store and started processes per stage: ~7 s before
the first row on 2 idle cores and 19 GB RSS at 100k images. Here a small input
gets no more actors than it has blocks, and a process that asks for
``WORKER_PRELOAD`` gets actors that already have what they import.

What Ray Data costs on top of a plain pool of actors: three helper actors of
its own (stats, autoscaling coordinator, actor locations), each a worker
process, and the driver's scheduling loop. They are detached, so a long-lived
cluster pays for them once; a fresh embedded one pays each night: 20k images
took ~12.5 CPU seconds against ~7.5 with plain actors on 2 idle cores (the
stats actor ~3.5, mostly its worker's start; the driver ~1 more).
``bench/batch_inference.py`` measures it against a plain loop.

Layout::

    <output_root>/<partition>/run-<id>/predictions/part-*.parquet
    <output_root>/<partition>/run-<id>/errors/part-*.parquet
    <output_root>/<partition>/manifest.json    the commit point
    <output_root>/<partition>/_SUCCESS
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from pydantic import BaseModel, Field

from ray_workloads.inference_predictor import BLOCK_COLUMNS, PredictorUDF, WrittenFile
from ray_workloads.ingest import content_hash
from rayline import errors, storage
from rayline.errors import ClusterError, InputDataError, RaylineError, StorageError
from rayline.registry import ModelVersion

if TYPE_CHECKING:
    from ray.data import Dataset

MANIFEST = "manifest.json"
SUCCESS = "_SUCCESS"
# A lost actor (OOM, node loss, killed) is restarted and its block retried;
# an input that kills its actor every time fails the run after this many.
# (Ray Data's default is to restart and retry forever.)
_ACTOR_RESTARTS = 3
# What a process that runs batch inference asks its embedded Ray cluster to
# import in every worker at start (``ray_cluster.connect(preload=...)``), so
# that a predictor actor starts in ~0.3 s rather than ~1.5 s (2 idle cores):
# torch for the model; ray.data, and ray.util.state that unpickling Ray Data's
# context imports, for the actor pool's worker; the UDF's own module.
WORKER_PRELOAD = ("torch", "ray.data", "ray.util.state", "ray_workloads.inference_predictor")


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
    ray_data_stats: str = Field("", description="Ray Data's execution stats of the predict-and-write stage.")

    @property
    def error_fraction(self) -> float:
        return self.errors / self.inputs if self.inputs else 0.0

    @property
    def errors_uri(self) -> str:
        return storage.join(self.partition_uri, f"run-{self.run_id}", "errors")


def _constants(cfg: InferenceConfig) -> dict[str, Any]:
    """Columns with one value per run, added to every prediction row."""
    return {
        "model_name": cfg.model.name,
        "model_version": cfg.model.version,
        "code_version": cfg.code_version,
        "flow_run_id": cfg.flow_run_id or "",
    }


def _blocks(objects: list[storage.ObjectInfo], size: int) -> list[dict[str, list[str]]]:
    """One row (URIs and ETags) per block of ``size`` objects."""
    uris, etags = BLOCK_COLUMNS
    parts = (objects[i : i + size] for i in range(0, len(objects), size))
    return [{uris: [o.uri for o in part], etags: [o.etag for o in part]} for part in parts]


def _predict_and_write(cfg: InferenceConfig, objects: list[storage.ObjectInfo], run_uri: str) -> Dataset:
    """Run the predictor actors over every block; the result holds their reports, materialized."""
    import ray.data  # here: the driver process needs it only while it runs inference

    blocks = _blocks(objects, cfg.objects_per_task)
    dataset = ray.data.from_items(blocks, override_num_blocks=len(blocks))  # one Ray Data block per block
    context = dataset.context  # this dataset's own copy: the process-wide settings stay as they are
    context.enable_progress_bars = False  # a bar per night in the logs of a Prefect task tells nobody anything
    context.raise_original_map_exception = True  # rayline's own errors reach the driver as themselves
    reports = dataset.map_batches(
        PredictorUDF,
        fn_constructor_args=(cfg.model, cfg.top_k, cfg.batch_size, cfg.io_concurrency, run_uri, _constants(cfg)),
        batch_size=1,  # one block per call: it writes one file of each kind
        batch_format="pyarrow",
        # a small night needs no more actors than it has blocks: each costs a process and a model load
        compute=ray.data.ActorPoolStrategy(size=min(cfg.actors, len(blocks))),
        num_cpus=cfg.cpus_per_actor,
        num_gpus=cfg.gpus_per_actor,
        max_restarts=_ACTOR_RESTARTS,
        max_task_retries=_ACTOR_RESTARTS,
    )
    return _surfacing_errors(reports.materialize)


def _surfacing_errors(execute: Callable[[], Dataset]) -> Dataset:
    """Run ``execute``; rayline's errors raised in an actor come out as themselves, lost actors as ClusterError."""
    try:
        return execute()
    except Exception as exc:
        causes = list(errors.causes(exc))
        # the remote exception itself, not Ray's RayTaskError(...) subclass that wraps it
        ours = [e for e in causes if isinstance(e, RaylineError) and not isinstance(e, ray.exceptions.RayTaskError)]
        if ours:
            raise ours[0] from exc
        if any(isinstance(e, ray.exceptions.RayActorError) for e in causes):
            raise ClusterError(
                f"a predictor actor died more than {_ACTOR_RESTARTS} times (out of memory, a lost node, or an "
                f"input that crashes the decoder or the model): {exc}"
            ) from exc
        raise


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
    objects = storage.list_objects(source)
    if not objects:
        raise InputDataError(f"no input objects under {source}")
    phases.lap("list")
    reports = _predict_and_write(cfg, objects, storage.join(partition_uri, f"run-{run_id}"))
    ray_data_stats = reports.stats()  # before reading the reports: iterating adds its own stats
    written = [WrittenFile.from_report(row) for row in reports.iter_rows()]
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
        ray_data_stats=ray_data_stats,
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
