"""Flow ``train-model``: prepare data → train → evaluate → register → promotion gate."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from rayline.config import labelled_win_required
from rayline.errors import ConfigError
from rayline.flows.prepare_data import DIGITS_IMAGE_SIZE, PrepareDataResult, prepare_data
from rayline.models.registry import CHAMPION, GATE_ALPHA, TrainingLabels
from rayline.ray_workloads.architectures.build import ModelSpec, check_input_size
from rayline.ray_workloads.quality.training_set import ExportConfig
from rayline.ray_workloads.training.evaluate import EvaluationResult
from rayline.ray_workloads.training.loop import TrainLoopConfig
from rayline.ray_workloads.training.train import TrainConfig, TrainResult
from rayline.ray_workloads.training.tune import TuneJobConfig, TuneResult
from rayline.storage.layout import (
    RAW_DIR,
    TRAINING_DIR,
    TUNING_DIR,
    check_input_apart_from_checkpoints,
    checkpoints_uri,
    root_uri,
    under_root,
)
from rayline.storage.layout import (
    model_name as checked_model_name,
)
from rayline.tasks.labels import export_labelled_task
from rayline.tasks.register import RegistrationResult, register_and_gate
from rayline.tasks.registry_lookups import alias_version_task, reconcile_mirror_task, resolve_version_task
from rayline.tasks.train import evaluate_task, train_model_task
from rayline.tasks.training_plan import DEFAULT_MODEL, plan_training_task
from rayline.tasks.tune import tune_task


class TrainModelResult(BaseModel):
    data: PrepareDataResult
    tuned: TuneResult | None = None
    trained: TrainResult
    evaluation: EvaluationResult
    registration: RegistrationResult


def run_name(model_name: str, data_hash: str, loop: TrainLoopConfig) -> str:
    """Same data and hyper-parameters → same run name → a rerun resumes its checkpoints."""
    # plain training leaves ``init`` out, so its run names (and resumable checkpoints) are those of before fine-tuning
    fields = loop.model_dump(mode="json", exclude={"init"} if loop.init is None else None)
    params = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return f"{model_name}-{data_hash[:10]}-{params[:8]}"


def _on_labels(
    model_name: str | None, source_uri: str | None, init_from: str | None
) -> tuple[str, str, str | None, TrainingLabels]:
    """(model, training source, fine-tune start, the labels it learns) of a training on the model's labelled
    photos: its champion fine-tuned on them (trained anew when it has none)."""
    if source_uri is not None or init_from is not None:
        raise ConfigError(
            "labelled=True trains the model's champion on its labelled photos: give no source_uri or init_from"
        )
    name = checked_model_name(model_name or DEFAULT_MODEL)
    champion = alias_version_task(name, CHAMPION)
    classes = resolve_version_task(name, champion).classes if champion is not None else []
    exported = export_labelled_task(ExportConfig(root=root_uri(), model_name=name, classes=classes))
    learned = TrainingLabels(labels_version=exported.labels_version, import_ids=exported.import_ids)
    return name, exported.folder, (f"{name}@{CHAMPION}" if champion is not None else None), learned


@flow(name="train-model")
def train_model(
    model_name: str | None = None,
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
    alpha: float = GATE_ALPHA,
    fail_once_at_epoch: int | None = None,
    tune_samples: int = 0,
    tune_max_epochs: int = 4,
    promote_to: Literal["champion", "challenger"] = "champion",
    init_from: str | None = None,
    freeze_backbone: bool | None = None,
    require_labelled_win: bool | None = None,
    labelled: bool = False,
) -> TrainModelResult:
    """Train a classifier on ``source_uri`` (default ``<storage>/raw``) and gate it into the registry.

    With ``tune_samples > 0`` an ASHA search runs first and its best
    hyper-parameters are trained to completion for ``epochs`` epochs. A model
    that passes the gate becomes ``promote_to``: ``champion``, or
    ``challenger`` when a serve rollout is to promote it. The first champion
    passes ``floor``; a later model must beat the champion on the same test
    images by ``margin`` in accuracy and by an exact McNemar test at
    ``alpha`` (the most often one no better than the champion passes).

    Fine-tuning (``init_from="NAME@champion"``, or retraining a model whose
    champion is a fine-tune: see :func:`rayline.tasks.training_plan.plan_training`) starts from the
    parent's weights with a new head sized to the data's classes, prepares the
    data with the parent's image spec, never searches, and registers under
    ``model_name`` (default ``<parent>-ft``) with a ``parent`` link. ``arch``
    and ``width`` are then the parent's. ``freeze_backbone`` trains the head only.

    ``require_labelled_win`` (default ``RAYLINE_REQUIRE_LABELLED_WIN``): the
    champion moves only when the labels say the model beats it (the paired
    test, docs/quality.md); until they decide it is challenger, which the
    nights can shadow-score (``RAYLINE_SHADOW_CHALLENGER``).

    ``labelled``: train on the model's labelled photos (``rayline labels
    import``), copied to ``<storage>/labelled/<model>/`` with lineage back to
    each labels import, fine-tuning its champion (the ``retrain`` deployment
    does it on ``rayline.labels.arrived``).
    """
    learned: TrainingLabels | None = None
    if labelled:
        model_name, source_uri, init_from, learned = _on_labels(model_name, source_uri, init_from)
    if init_from is None:
        # an unknown name, or one that cannot take the squares prepare_data makes, fails before any cluster time
        check_input_size(arch, DIGITS_IMAGE_SIZE)
    name, plan = plan_training_task(model_name, init_from, freeze_backbone)
    reconcile_mirror_task(name)  # before anything can fail: completes a mirror an earlier run left unfinished
    if plan is not None and tune_samples > 0:
        # each ASHA trial would be a whole fine-tune of a torchvision model at the parent's
        # resolution (224 px for ImageNet weights): more than a small CPU cluster can take
        get_run_logger().info(
            "fine-tuning %s from %s v%d (%s): no hyper-parameter search, tune_samples=%d ignored",
            name,
            plan.parent.name,
            plan.parent.version,
            plan.why,
            tune_samples,
        )
        tune_samples = 0
    if source_uri is None and plan is not None and plan.data_source is not None:
        source_uri = plan.data_source  # retraining a fine-tune: the prefix it was fine-tuned on, not the digits
    # before any work: checkpoints apart from every input (Tune unpickles what it finds there)
    check_input_apart_from_checkpoints(source_uri or under_root(RAW_DIR), "source_uri")
    data = prepare_data(  # training on it now: no retraining announced
        source_uri=source_uri, announce_retrain=False, image=plan.parent.image_spec if plan else None
    )
    model = plan.parent.model_spec if plan else ModelSpec(arch=arch, width=width)
    loop = TrainLoopConfig(
        model=model,
        init=plan.init() if plan else None,
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
                output_root=checkpoints_uri(TUNING_DIR),
                experiment_name=run_name(f"{name}-tune{tune_samples}", data.ingest.content_hash, loop),
                num_samples=tune_samples,
                max_epochs=tune_max_epochs,
                tracking_experiment=name,
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
            output_root=checkpoints_uri(TRAINING_DIR),
            run_name=run_name(name, data.ingest.content_hash, loop),
            loop=loop,
            num_workers=num_workers,
            cpus_per_worker=cpus_per_worker,
        ),
        tracking_experiment=name,
    )
    evaluation = evaluate_task(loop.model, trained.weights_uri, manifest, trained.run_uri, tracking_experiment=name)
    registration = register_and_gate(
        name,
        loop.model,
        trained,
        evaluation,
        margin=margin,
        floor=floor,
        alpha=alpha,
        promote_to=promote_to,
        parent=plan.parent_link() if plan else None,
        labelled_root=root_uri() if labelled_win_required(require_labelled_win) else None,
        trained_on_labels=learned,
    )
    create_table_artifact(
        key="train-model-summary",
        table=[
            {"item": "model", "value": f"{name} v{registration.version.version}"},
            {
                "item": "fine-tuned from",
                "value": (
                    f"{plan.parent.name} v{plan.parent.version}{' (head only)' if plan.freeze_backbone else ''}"
                    if plan
                    else "-"
                ),
            },
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
