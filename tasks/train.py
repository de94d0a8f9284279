"""Prefect tasks: train with Ray Train, evaluate on the held-out split."""

from __future__ import annotations

import re

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from rayline import storage
from rayline.models import tracking
from rayline.ray_workloads.training import evaluate, train
from rayline.tasks.common import png_markdown, ray_task, record_lineage

# an attempt's marks: when and where it resumed, not how well (epoch_ended_at stamps each point instead)
_UNTRACKED = {"attempt_started_at", "attempt_start_epoch"}


@ray_task("train")
def train_model_task(config: train.TrainConfig, tracking_experiment: str | None = None) -> train.TrainResult:
    """Fit; with MLflow tracking on, the run is logged into ``tracking_experiment`` (default: the run name)."""
    result = train.run(config)
    logger = get_run_logger()
    if result.reused:
        logger.info("training run %s had finished with this data and loop: its result reused", result.run_name)
    for h in result.history:
        figures = (h.train_loss, h.train_accuracy, h.val_loss, h.val_accuracy)
        logger.info("epoch %d: train loss %.4f acc %.4f, val loss %.4f acc %.4f", h.epoch, *figures)
    create_table_artifact(
        key="train-epochs",
        table=[{k: round(float(v), 4) for k, v in h.model_dump().items()} for h in result.history],
        description=f"Ray Train run `{result.run_name}`: best checkpoint `{result.checkpoint_uri}`",
    )
    curves = {
        "train accuracy": [(h.epoch, h.train_accuracy) for h in result.history],
        "val accuracy": [(h.epoch, h.val_accuracy) for h in result.history],
        "train loss": [(h.epoch, h.train_loss) for h in result.history],
    }
    png = evaluate.curves_png(curves, "value", f"training curves: {result.run_name}")
    png_uri = storage.join(result.run_uri, "curves.png")
    storage.write_bytes_atomic(png_uri, png)
    create_markdown_artifact(key="train-curves", markdown=png_markdown("Training curves", png, png_uri))
    tracking.log_training(
        tracking_experiment or result.run_name,
        result.run_uri,
        result.run_name,
        config.model_dump(mode="json"),
        [h.model_dump(exclude=_UNTRACKED) for h in result.history],
        {"curves.png": png},
    )
    record_lineage("train", result, parameters=config.model_dump(mode="json"))
    return result


@ray_task("evaluate")
def evaluate_task(
    config: train.TrainConfig, trained: train.TrainResult, tracking_experiment: str
) -> evaluate.EvaluationResult:
    """Evaluate the trained weights on the test split; with tracking on, into the MLflow run of the Train run."""
    spec = config.loop.model
    result = evaluate.run(spec, trained.weights_uri, config.data_manifest_uri, trained.run_uri)
    get_run_logger().info("test accuracy %.4f on %d samples", result.accuracy, result.samples)
    create_table_artifact(
        key="evaluation-per-class",
        table=[c.model_dump() for c in result.per_class],
        description=f"Accuracy {result.accuracy:.4f} on {result.samples} {result.split} images",
    )
    if result.confusion_png_uri:
        png = storage.read_bytes(result.confusion_png_uri)
        create_markdown_artifact(
            key="evaluation-confusion", markdown=png_markdown("Confusion matrix", png, result.confusion_png_uri)
        )
    _track_evaluation(tracking_experiment, trained.run_uri, result)
    record_lineage("evaluate", result, parameters={"split": result.split, "model": spec.model_dump()})
    return result


def _track_evaluation(experiment: str, run_uri: str, result: evaluate.EvaluationResult) -> None:
    """Test accuracy, per-class precision/recall and the confusion matrix (JSON and PNG) into MLflow."""
    if tracking.tracking_uri() is None:
        return
    metrics = {"test_accuracy": result.accuracy, "test_samples": float(result.samples)}
    for c in result.per_class:
        label = re.sub(r"[^\w\-. /]", "_", c.name)  # the characters MLflow allows in a metric name
        metrics[f"test_precision.{label}"] = c.precision
        metrics[f"test_recall.{label}"] = c.recall
    report = result.model_dump_json(include={"split", "samples", "accuracy", "per_class", "confusion"}, indent=1)
    files = {"evaluation.json": report.encode()}
    if result.confusion_png_uri:
        files["confusion.png"] = storage.read_bytes(result.confusion_png_uri)
    tracking.log_evaluation(experiment, run_uri, run_uri.rstrip("/").rsplit("/", 1)[-1], metrics, files)
