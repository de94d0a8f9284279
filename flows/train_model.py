"""Flow ``train-model``: prepare data → train → evaluate → register → promotion gate."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from flows.prepare_data import PrepareDataResult, prepare_data
from ray_workloads.evaluate import EvaluationResult
from ray_workloads.models import ModelSpec
from ray_workloads.train import TrainConfig, TrainResult
from ray_workloads.training_loop import TrainLoopConfig
from ray_workloads.tune import TuneJobConfig, TuneResult
from rayline import storage
from tasks.register import RegistrationResult, register_and_gate
from tasks.train import evaluate_task, train_model_task
from tasks.tune import tune_task

TRAINING_DIR = "training"
TUNING_DIR = "tuning"


class TrainModelResult(BaseModel):
    data: PrepareDataResult
    tuned: TuneResult | None = None
    trained: TrainResult
    evaluation: EvaluationResult
    registration: RegistrationResult


def run_name(model_name: str, data_hash: str, loop: TrainLoopConfig) -> str:
    """Same data and hyper-parameters → same run name → a rerun resumes its checkpoints."""
    params = hashlib.sha256(json.dumps(loop.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    return f"{model_name}-{data_hash[:10]}-{params[:8]}"


@flow(name="train-model")
def train_model(
    model_name: str = "digits",
    source_uri: str | None = None,
    arch: str = "small_cnn",
    width: int = 32,
    epochs: int = 12,
    lr: float = 3e-3,
    batch_size: int = 32,
    weight_decay: float = 1e-4,
    num_workers: int = 2,
    cpus_per_worker: float = 0.5,
    margin: float = 0.0,
    floor: float = 0.9,
    fail_once_at_epoch: int | None = None,
    tune_samples: int = 0,
    tune_max_epochs: int = 4,
    promote_to: Literal["champion", "challenger"] = "champion",
) -> TrainModelResult:
    """Train a classifier on ``source_uri`` (default ``<storage>/raw``) and gate it into the registry.

    With ``tune_samples > 0`` an ASHA search runs first and its best
    hyper-parameters are trained to completion for ``epochs`` epochs. A model
    that passes the gate becomes ``promote_to``: ``champion``, or
    ``challenger`` when a serve rollout is to promote it.
    """
    data = prepare_data(source_uri=source_uri, announce_retrain=False)  # training on it now
    loop = TrainLoopConfig(
        model=ModelSpec(arch=arch, width=width),
        lr=lr,
        batch_size=batch_size,
        weight_decay=weight_decay,
        epochs=epochs,
        fail_once_at_epoch=fail_once_at_epoch,
    )
    manifest = data.preprocess.manifest_uri
    searched: TuneResult | None = None
    if tune_samples > 0:
        searched = tune_task(
            TuneJobConfig(
                data_manifest_uri=manifest,
                output_root=storage.join(storage.storage_root(), TUNING_DIR),
                experiment_name=run_name(f"{model_name}-tune{tune_samples}", data.ingest.content_hash, loop),
                num_samples=tune_samples,
                max_epochs=tune_max_epochs,
            ),
            loop,
        )
        best = searched.best_config
        loop = loop.model_copy(
            update={
                "model": best.model,
                "lr": best.lr,
                "batch_size": best.batch_size,
                "weight_decay": best.weight_decay,
            }
        )
    trained = train_model_task(
        TrainConfig(
            data_manifest_uri=manifest,
            output_root=storage.join(storage.storage_root(), TRAINING_DIR),
            run_name=run_name(model_name, data.ingest.content_hash, loop),
            loop=loop,
            num_workers=num_workers,
            cpus_per_worker=cpus_per_worker,
        )
    )
    evaluation = evaluate_task(loop.model, trained.weights_uri, manifest, trained.run_uri)
    registration = register_and_gate(
        model_name, loop.model, trained, evaluation, margin=margin, floor=floor, promote_to=promote_to
    )
    create_table_artifact(
        key="train-model-summary",
        table=[
            {"item": "model", "value": f"{model_name} v{registration.version.version}"},
            {"item": "test accuracy", "value": f"{evaluation.accuracy:.4f}"},
            {"item": "gate", "value": registration.decision.reason},
            {"item": "champion", "value": f"v{registration.champion}" if registration.champion else "none"},
            {"item": "epochs", "value": str(trained.epochs)},
            {"item": "weights", "value": registration.version.weights_uri},
        ],
    )
    return TrainModelResult(
        data=data, tuned=searched, trained=trained, evaluation=evaluation, registration=registration
    )
