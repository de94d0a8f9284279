"""Training: Ray Train's TorchTrainer (V2 API) over the preprocessed shards.

Checkpoints go to the storage root, the best N are kept; a worker crash resumes from the latest one and
running again with the same run name resumes instead of starting over. A finished run leaves its result
beside its checkpoints (``TRAIN_RESULT_FILE``), returned again for the same data and loop.

Each worker asks for ``cpus_per_worker`` logical CPUs (0.5 by default) and uses one torch thread, so two
workers and Ray Data's feeding tasks share a small machine's CPUs without starving each other.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
from pydantic import BaseModel, Field, ValidationError
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from rayline import progress, storage
from rayline.errors import InputDataError, RetriesExhausted
from rayline.lineage import DatasetRef
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.execution.interface import runtime_env
from rayline.ray_workloads.training.loop import (
    TrainLoopConfig,
    epoch_batches,
    initial_model,
    make_optimizer,
    train_epochs,
)
from rayline.ray_workloads.training.request import TrainShape
from rayline.storage.layout import TRAIN_RESULT_FILE, TRAIN_STATE_FILE, WEIGHTS_FILE

SCORE = "val_accuracy"  # the EpochMetrics field that ranks checkpoints


class TrainConfig(TrainShape):
    """A training run: data, hyper-parameters and compute shape."""

    data_manifest_uri: str
    output_root: str
    run_name: str
    loop: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    use_gpu: bool | None = Field(None, description="None: use GPUs when the cluster has them.")
    max_failures: int = Field(2, ge=0)
    keep_checkpoints: int = Field(2, ge=1)


class EpochMetrics(BaseModel):
    """One epoch's figures and wall-clock marks, in the order reported (and logged to MLflow); the checkpoint
    keeps them as plain dicts (``torch.load(weights_only=True)`` reads no classes)."""

    epoch: int
    attempt_start_epoch: int = Field(description="The epoch the attempt that ran this one started at (resumes).")
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    train_samples: int
    val_samples: int
    train_seconds: float
    attempt_started_at: float = Field(description="Unix time the attempt started.")
    epoch_ended_at: float = Field(description="Unix time the epoch ended.")


class TrainResult(BaseModel):
    run_name: str
    run_uri: str
    checkpoint_uri: str
    weights_uri: str
    metrics: dict[str, float]
    history: list[EpochMetrics]
    epochs: int
    elapsed_s: float
    samples_per_s: float
    data_manifest_uri: str = Field(description="The preprocessed data it trained on.")
    init_weights_uri: str | None = Field(None, description="The weights a fine-tune started from.")
    reused: bool = Field(False, description="A finished run's result, returned without training again.")

    def lineage_inputs(self) -> list[DatasetRef]:
        start = [DatasetRef(uri=self.init_weights_uri)] if self.init_weights_uri is not None else []
        return [DatasetRef(uri=self.data_manifest_uri, stored_as="manifest"), *start]

    def lineage_outputs(self) -> list[DatasetRef]:
        return [DatasetRef(uri=self.checkpoint_uri, facets={"metrics": self.metrics}, stored_as="folder")]


# smaller splits are read by the driver into in-memory blocks: a streaming read costs seconds to start
SMALL_SPLIT_ROWS = 50_000


def dataset_for_split(
    prepared: preprocess.PreprocessResult, split: str, columns: Sequence[str] = ("image", "label_index")
) -> ray.data.Dataset:
    """The preprocessed rows of one split as a Ray Dataset (``columns``): reads the manifest's list of files."""
    uris = prepared.read_files().get(split, []) if prepared.file_counts.get(split) else []
    if not uris:
        raise InputDataError(f"preprocessed data {prepared.output_uri} has no {split!r} split")
    columns = list(columns)
    if prepared.counts.get(split, 0) <= SMALL_SPLIT_ROWS:
        return ray.data.from_arrow(storage.read_parquet(uris).select(columns))
    fs, _ = storage.arrow_filesystem(uris[0])
    paths = [storage.arrow_filesystem(u)[1] for u in uris]
    return ray.data.read_parquet(paths, filesystem=fs, columns=columns)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under a DistributedDataParallel wrapper."""
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, torch.nn.Module) else model


def save_state(folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Write weights (tensors only) and the resumable training state into ``folder``."""
    weights = {k: v.detach().cpu() for k, v in _unwrap(model).state_dict().items()}
    torch.save(weights, os.path.join(folder, WEIGHTS_FILE))
    torch.save({**state, "optimizer": optimizer.state_dict()}, os.path.join(folder, TRAIN_STATE_FILE))


def restore_state(
    checkpoint: ray.train.Checkpoint | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Load what :func:`save_state` wrote; None when there is no checkpoint to resume from."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        _unwrap(model).load_state_dict(torch.load(os.path.join(folder, WEIGHTS_FILE), weights_only=True))
        state: dict[str, Any] = torch.load(os.path.join(folder, TRAIN_STATE_FILE), weights_only=True)
    optimizer.load_state_dict(state.pop("optimizer"))
    return state


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker: resume if a checkpoint exists, then train and report per epoch."""
    cfg = TrainLoopConfig.model_validate(config)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # workers share few cores; more threads only contend
    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    # Batch sources first: their first pass then runs while DDP is set up.
    train_batches = epoch_batches(ray.train.get_dataset_shard("train").iter_torch_batches, cfg, shuffle=True)
    val_batches = epoch_batches(ray.train.get_dataset_shard("val").iter_torch_batches, cfg, shuffle=False)
    model = ray.train.torch.prepare_model(initial_model(cfg))
    optimizer = make_optimizer(model, cfg)
    state = restore_state(ray.train.get_checkpoint(), model, optimizer) or {"epoch": -1, "history": []}
    start_epoch = int(state["epoch"]) + 1
    history: list[dict[str, Any]] = list(state["history"])  # as the checkpoint keeps it

    attempt_started = time.time()
    batches = (train_batches, val_batches)
    for epoch, train, val in train_epochs(model, optimizer, cfg, start_epoch, batches, device, drills=rank == 0):
        metrics = EpochMetrics(
            epoch=epoch,
            attempt_start_epoch=start_epoch,
            train_loss=train.loss,
            train_accuracy=train.accuracy,
            val_loss=val.loss,
            val_accuracy=val.accuracy,
            train_samples=train.samples,
            val_samples=val.samples,
            train_seconds=train.seconds,
            attempt_started_at=attempt_started,
            epoch_ended_at=time.time(),
        ).model_dump()
        history.append(metrics)
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if rank == 0:
                save_state(folder, model, optimizer, {"epoch": epoch, "history": history})
                checkpoint = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=checkpoint)


def _first_failure(exc: ray.train.TrainingFailedError) -> BaseException:
    """The lowest rank's error of a failed worker group, the controller's error, or ``exc`` itself."""
    workers: dict[int, BaseException] = getattr(exc, "worker_failures", None) or {}
    if workers:
        return workers[min(workers)]
    controller = getattr(exc, "controller_failure", None)
    return controller if isinstance(controller, BaseException) else exc


def _use_gpu(cfg: TrainConfig) -> bool:
    if cfg.use_gpu is not None:
        return cfg.use_gpu
    return float(ray.cluster_resources().get("GPU", 0)) > 0  # type: ignore[no-untyped-call]


class _EpochProgress(ray.train.UserCallback):
    """Counts finished epochs for the CLI's progress; runs in the Train controller, hence the remote counter."""

    def __init__(self, shown: progress.Stage) -> None:
        self.shown = shown

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if metrics and "epoch" in metrics[0]:
            self.shown.set(int(metrics[0]["epoch"]) + 1)


class _FinishedRun(BaseModel):
    """What :data:`TRAIN_RESULT_FILE` holds: the config a fit finished with, and its result."""

    config: TrainConfig
    result: TrainResult


def run_folder(cfg: TrainConfig) -> str:
    """The run's folder under the output root: Ray Train's checkpoints and :data:`TRAIN_RESULT_FILE`."""
    return storage.join(storage.normalize(cfg.output_root), cfg.run_name)


def finished_result(cfg: TrainConfig) -> TrainResult | None:
    """The result of this run if it already finished with the same data and loop, its best weights still there
    (Ray Train would start a whole worker group to train none); the compute shape changes no result."""
    uri = storage.join(run_folder(cfg), TRAIN_RESULT_FILE)
    if not storage.exists(uri):
        return None
    try:
        finished = _FinishedRun.model_validate(storage.read_json(uri))
    except (InputDataError, ValidationError):  # unreadable, or written by another version: train (resume) instead
        return None
    same = finished.config.loop == cfg.loop and finished.config.data_manifest_uri == cfg.data_manifest_uri
    if not same or not storage.exists(finished.result.weights_uri):
        return None
    return finished.result


def run(cfg: TrainConfig) -> TrainResult:
    """Fit with Ray Train; resumes from this run name's checkpoints if any exist, or returns its finished result."""
    started = time.perf_counter()
    finished = finished_result(cfg)
    if finished is not None:
        return finished.model_copy(update={"reused": True, "elapsed_s": time.perf_counter() - started})
    result = _fit(cfg)
    # written after the fit's last checkpoint: a run killed before it is resumed by Ray Train instead
    storage.write_json_atomic(
        storage.join(run_folder(cfg), TRAIN_RESULT_FILE),
        _FinishedRun(config=cfg, result=result).model_dump(mode="json"),
    )
    return result


def _fit(cfg: TrainConfig) -> TrainResult:
    started = time.perf_counter()
    prepared = preprocess.read_manifest(cfg.data_manifest_uri)
    loop = _workers_loop(cfg, prepared)
    with progress.stage("train", total=loop.epochs, unit="epochs", remote=True) as shown:
        try:
            fitted = _trainer(cfg, loop, prepared, shown).fit()
        except ray.train.TrainingFailedError as exc:
            # Ray Train already restarted the workers max_failures times: Prefect must not run it all again
            raise RetriesExhausted(f"training run {cfg.run_name}", cfg.max_failures + 1, _first_failure(exc)) from exc
    best = fitted.get_best_checkpoint(metric=SCORE, mode="max")
    if best is None or fitted.checkpoint is None:
        raise InputDataError(f"training run {cfg.run_name} produced no checkpoint")
    with fitted.checkpoint.as_directory() as folder:
        saved = torch.load(Path(folder) / TRAIN_STATE_FILE, weights_only=True)["history"]
    history = [EpochMetrics.model_validate(h) for h in saved]
    best_uri = storage.uri_of_path(best.path, storage.normalize(cfg.output_root))
    samples = sum(h.train_samples for h in history)
    seconds = sum(h.train_seconds for h in history)
    best_metrics = max(history, key=lambda h: h.val_accuracy)  # the first of equal epochs
    return TrainResult(
        run_name=cfg.run_name,
        run_uri=run_folder(cfg),
        checkpoint_uri=best_uri,
        weights_uri=storage.join(best_uri, WEIGHTS_FILE),
        metrics={k: float(v) for k, v in best_metrics.model_dump().items()},
        history=history,
        epochs=len(history),
        elapsed_s=time.perf_counter() - started,
        samples_per_s=samples / seconds if seconds else 0.0,
        data_manifest_uri=cfg.data_manifest_uri,
        init_weights_uri=cfg.loop.init.weights_uri if cfg.loop.init else None,
    )


def _workers_loop(cfg: TrainConfig, prepared: preprocess.PreprocessResult) -> TrainLoopConfig:
    """The loop the workers run: a head for the data's classes, and the fault drill's marker in the run's folder.
    Every worker validates on all of a small validation split, which spares starting a split coordinator."""
    model = cfg.loop.model.model_copy(update={"num_classes": len(prepared.classes)})
    whole_split = prepared.counts.get("val", 0) <= SMALL_SPLIT_ROWS
    loop = cfg.loop.model_copy(update={"model": model, "val_on_every_worker": whole_split})
    if loop.fail_once_at_epoch is not None and loop.fail_marker_uri is None:
        loop = loop.model_copy(update={"fail_marker_uri": storage.join(run_folder(cfg), "_fault_drill_done")})
    return loop


def _trainer(
    cfg: TrainConfig, loop: TrainLoopConfig, prepared: preprocess.PreprocessResult, shown: progress.Stage
) -> TorchTrainer:
    """The run's TorchTrainer: its workers, its checkpoints (the best kept) and its datasets."""
    fs, storage_path = storage.arrow_filesystem(storage.normalize(cfg.output_root))
    use_gpu = _use_gpu(cfg)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop.model_dump(mode="json"),
        scaling_config=ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
        ),
        run_config=RunConfig(
            name=cfg.run_name,
            storage_path=storage_path,
            storage_filesystem=fs,
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            worker_runtime_env=runtime_env(loop.model) or {},  # type: ignore[call-arg]  # Train v2 has it; the stub is v1
            callbacks=[_EpochProgress(shown)],  # type: ignore[list-item]  # a UserCallback; the stub says Callback
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.keep_checkpoints,
                checkpoint_score_attribute=SCORE,
                checkpoint_score_order="max",
            ),
        ),
        datasets={"train": dataset_for_split(prepared, "train"), "val": dataset_for_split(prepared, "val")},
        dataset_config=DataConfig(datasets_to_split=["train"] if loop.val_on_every_worker else "all"),
    )
