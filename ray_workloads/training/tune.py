"""Hyper-parameter search: Ray Tune with the ASHA scheduler.

Each trial is a function running the Ray Train workers' epoch loop (``loop``) over the same datasets
(``train.dataset_for_split``): no second data preparation, no TorchTrainer start-up per trial. Trials
checkpoint every epoch, so an interrupted search restores with ``Tuner.restore`` without rerunning finished
trials. With MLflow tracking on, every trial is a run nested under one parent run per search.
"""

from __future__ import annotations

import logging
import tempfile
import time
from typing import Any

import ray
import torch
from pydantic import BaseModel, Field
from ray import tune
from ray.air.integrations.mlflow import MLflowLoggerCallback
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from rayline import progress, storage
from rayline.errors import RetriesExhausted
from rayline.lineage import DatasetRef
from rayline.models import tracking
from rayline.ray_workloads.architectures.build import ModelSpec, build_model
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.training.loop import TrainLoopConfig, epoch_batches, make_optimizer, train_epochs
from rayline.ray_workloads.training.train import SCORE, dataset_for_split, restore_state, save_state


class SearchSpace(BaseModel):
    """What Tune samples; ranges are log-uniform, lists are choices."""

    lr: tuple[float, float] = (1e-3, 1e-2)
    weight_decay: tuple[float, float] = (1e-5, 1e-3)
    batch_size: list[int] = Field(default_factory=lambda: [32, 64])
    width: list[int] = Field(default_factory=lambda: [16, 32])
    arch: list[str] = Field(default_factory=lambda: ["small_cnn"])


class TuneJobConfig(BaseModel):
    """A search: data, space, budget and compute shape."""

    data_manifest_uri: str
    output_root: str
    experiment_name: str
    space: SearchSpace = Field(default_factory=SearchSpace)
    num_samples: int = Field(8, ge=1)
    max_epochs: int = Field(6, ge=1)
    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2.0, gt=1)
    cpus_per_trial: float = Field(0.5, ge=0.1, description="Tune refuses 0; 0.1 is the floor.")
    max_concurrent_trials: int | None = Field(None, ge=1)
    seed: int = 0
    tracking_experiment: str | None = Field(None, description="MLflow experiment of the trials (experiment_name).")


log = logging.getLogger(__name__)


class _SafeMLflowLogger(MLflowLoggerCallback):
    """Ray's callback, but an MLflow failure turns the logging off: the Tune experiment on storage is the record."""

    _failed = False

    def _guard(self, what: str, call: Any, *args: Any, **kwargs: Any) -> None:
        if self._failed:
            return
        try:
            call(*args, **kwargs)
        except Exception as exc:  # any MLflow problem only costs the mirror
            self._failed = True
            log.warning("MLflow: %s failed (%s: %s); trials are no longer logged", what, type(exc).__name__, exc)

    def setup(self, *args: Any, **kwargs: Any) -> None:
        self._guard("setup", super().setup, *args, **kwargs)

    def log_trial_start(self, trial: Any) -> None:
        self._guard("trial start", super().log_trial_start, trial)

    def log_trial_result(self, iteration: int, trial: Any, result: dict[str, Any]) -> None:
        self._guard("trial result", super().log_trial_result, iteration, trial, result)

    def log_trial_end(self, trial: Any, failed: bool = False) -> None:
        self._guard("trial end", super().log_trial_end, trial, failed)


def mlflow_callbacks(cfg: TuneJobConfig, experiment_uri: str) -> list[tune.Callback]:
    """The trial logger when tracking is on and the server answers; the trials nest under a parent run
    of the search (one per experiment folder: a restored search logs into the same one)."""
    mlflow = tracking.client()
    if mlflow is None:
        return []
    experiment = cfg.tracking_experiment or cfg.experiment_name
    with tracking.best_effort(f"starting the MLflow run of search {cfg.experiment_name}"):
        parent = tracking.keyed_run(
            mlflow, experiment, experiment_uri, cfg.experiment_name, {tracking.STAGE_TAG: "tune"}
        )
        tracking.log_params(mlflow, parent, tracking.flatten(cfg.model_dump(mode="json", exclude={"space"})))
        tags = {"mlflow.parentRunId": parent, tracking.STAGE_TAG: "tune-trial", "rayline.search": cfg.experiment_name}
        return [_SafeMLflowLogger(tracking.tracking_uri(), experiment_name=experiment, tags=tags)]
    return []


class TrialSummary(BaseModel):
    trial_id: str
    config: dict[str, Any]
    epochs: int
    val_accuracy: float
    status: str
    curve: list[float] = Field(default_factory=list, description="Validation accuracy per epoch.")


class TuneResult(BaseModel):
    experiment_uri: str
    best_config: TrainLoopConfig
    best_metrics: dict[str, float]
    trials: list[TrialSummary]
    restored: bool
    elapsed_s: float
    data_manifest_uri: str = Field(description="The preprocessed data the trials trained on.")

    def lineage_inputs(self) -> list[DatasetRef]:
        return [DatasetRef(uri=self.data_manifest_uri, stored_as="manifest")]

    def tuned(self, loop: TrainLoopConfig) -> TrainLoopConfig:
        """``loop`` with the best trial's model (arch, width), lr, batch size and weight decay; the rest stay."""
        searched = ("model", "lr", "batch_size", "weight_decay")
        return loop.model_copy(update={field: getattr(self.best_config, field) for field in searched})

    def lineage_outputs(self) -> list[DatasetRef]:
        best = self.best_config.model_dump(mode="json")
        return [DatasetRef(uri=self.experiment_uri, facets={"best": best}, stored_as="folder")]


def loop_config(trial: dict[str, Any], base: TrainLoopConfig) -> TrainLoopConfig:
    """A trial's sampled values applied to the base training config."""
    model = base.model.model_copy(update={"arch": trial["arch"], "width": trial["width"]})
    return base.model_copy(update={"model": model, **{k: trial[k] for k in ("lr", "weight_decay", "batch_size")}})


def trial_fn(
    config: dict[str, Any], train_ds: ray.data.Dataset, val_ds: ray.data.Dataset, base: TrainLoopConfig
) -> None:
    """One Tune trial: the shared epoch loop, reporting and checkpointing every epoch."""
    cfg = loop_config(config, base)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    model = build_model(cfg.model)
    optimizer = make_optimizer(model, cfg)
    state = restore_state(tune.get_checkpoint(), model, optimizer) or {"epoch": -1, "history": []}
    train_batches = epoch_batches(train_ds.iter_torch_batches, cfg, shuffle=True)
    val_batches = epoch_batches(val_ds.iter_torch_batches, cfg, shuffle=False)
    batches = (train_batches, val_batches)
    for epoch, train, val in train_epochs(model, optimizer, cfg, int(state["epoch"]) + 1, batches, device):
        metrics = {"epoch": float(epoch), "train_loss": train.loss, "val_loss": val.loss, SCORE: val.accuracy}
        with tempfile.TemporaryDirectory() as folder:
            save_state(folder, model, optimizer, {"epoch": epoch, "history": []})
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))


def _curve(result: Any) -> list[float]:
    frame = result.metrics_dataframe
    if frame is None or SCORE not in frame:
        return []
    return [float(v) for v in frame[SCORE].tolist()]


def _param_space(space: SearchSpace) -> dict[str, Any]:
    return {
        "lr": tune.loguniform(*space.lr),
        "weight_decay": tune.loguniform(*space.weight_decay),
        "batch_size": tune.choice(space.batch_size),
        "width": tune.choice(space.width),
        "arch": tune.choice(space.arch),
    }


def _trainable(cfg: TuneJobConfig, prepared: preprocess.PreprocessResult, base: TrainLoopConfig) -> Any:
    train_ds = dataset_for_split(prepared, "train").materialize()
    val_ds = dataset_for_split(prepared, "val").materialize()
    fn = tune.with_parameters(trial_fn, train_ds=train_ds, val_ds=val_ds, base=base)
    return tune.with_resources(fn, {"cpu": cfg.cpus_per_trial})


class _TrialProgress(tune.Callback):
    """Counts finished trials (stopped early or not) for the CLI's progress; Tune calls it in this process."""

    def __init__(self, shown: progress.Stage) -> None:
        self.shown = shown

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.shown.add(1)

    on_trial_error = on_trial_complete


def tune_config(cfg: TuneJobConfig) -> tune.TuneConfig:
    """ASHA over ``cfg.num_samples`` seeded variants, at most ``cfg.max_concurrent_trials`` at a time: a limit
    on the variant generator, as beside one Ray ignores TuneConfig's ``max_concurrent_trials``."""
    return tune.TuneConfig(
        metric=SCORE,
        mode="max",
        scheduler=ASHAScheduler(
            time_attr="training_iteration",
            max_t=cfg.max_epochs,
            grace_period=cfg.grace_period,
            reduction_factor=cfg.reduction_factor,
        ),
        num_samples=cfg.num_samples,
        # same seed, same trials
        search_alg=BasicVariantGenerator(random_state=cfg.seed, max_concurrent=cfg.max_concurrent_trials or 0),
    )


def run(cfg: TuneJobConfig, base: TrainLoopConfig | None = None) -> TuneResult:
    """Search, or continue an interrupted search of the same name, and report the best config."""
    started = time.perf_counter()
    prepared = preprocess.read_manifest(cfg.data_manifest_uri)
    model = ModelSpec(num_classes=len(prepared.classes))
    base = (base or TrainLoopConfig()).model_copy(update={"epochs": cfg.max_epochs, "seed": cfg.seed, "model": model})
    experiment_uri = storage.join(storage.normalize(cfg.output_root), cfg.experiment_name)
    trainable = _trainable(cfg, prepared, base)
    with progress.stage("tune", total=cfg.num_samples, unit="trials") as shown:
        tuner, restored = _tuner(cfg, trainable, experiment_uri, shown)
        grid = tuner.fit()
    trials = [_trial_summary(grid[i]) for i in range(len(grid))]
    ok = [t for t in trials if t.status != "ERROR" and t.epochs > 0]
    if not ok:
        # Tune ran every trial to its own failure limit: a search run again fails the same way
        first = grid.errors[0] if grid.errors else "no trial reported a result"
        raise RetriesExhausted(f"every trial of Tune search {cfg.experiment_name}", len(trials), first)
    best = max(ok, key=lambda t: (t.val_accuracy, t.epochs))
    if tracking.tracking_uri() is not None:
        best_metrics = {"best_val_accuracy": best.val_accuracy, "trials": float(len(trials))}
        experiment = cfg.tracking_experiment or cfg.experiment_name
        tracking.finish_run(experiment, experiment_uri, cfg.experiment_name, best_metrics)
    return TuneResult(
        experiment_uri=experiment_uri,
        best_config=loop_config(best.config, base),
        best_metrics={"val_accuracy": best.val_accuracy, "epochs": float(best.epochs)},
        trials=trials,
        restored=restored,
        elapsed_s=time.perf_counter() - started,
        data_manifest_uri=cfg.data_manifest_uri,
    )


def _tuner(cfg: TuneJobConfig, trainable: Any, experiment_uri: str, shown: progress.Stage) -> tuple[tune.Tuner, bool]:
    """The search's Tuner, restored when an interrupted search of the same name left its state (True)."""
    fs, storage_path = storage.arrow_filesystem(storage.normalize(cfg.output_root))
    experiment_path = storage.join(storage_path, cfg.experiment_name)
    if tune.Tuner.can_restore(experiment_path, storage_filesystem=fs):
        return tune.Tuner.restore(
            experiment_path, trainable=trainable, resume_errored=True, storage_filesystem=fs
        ), True
    run_config = tune.RunConfig(
        name=cfg.experiment_name,
        storage_path=storage_path,
        storage_filesystem=fs,
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
        verbose=0,
        # a restored search keeps its first run's callbacks: shown without counts
        callbacks=[_TrialProgress(shown), *mlflow_callbacks(cfg, experiment_uri)],
    )
    tuner = tune.Tuner(
        trainable, param_space=_param_space(cfg.space), tune_config=tune_config(cfg), run_config=run_config
    )
    return tuner, False


def _trial_summary(result: Any) -> TrialSummary:
    """What one trial ran, from its Tune result."""
    metrics = result.metrics or {}
    return TrialSummary(
        trial_id=str(metrics.get("trial_id", "")),
        config=dict(result.config or {}),
        epochs=int(metrics.get("training_iteration", 0)),
        val_accuracy=float(metrics.get(SCORE, 0.0)),
        status="ERROR" if result.error else "TERMINATED",
        curve=_curve(result),
    )
