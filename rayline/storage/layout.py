"""Names of the storage layout, in one place: every stage and reader agrees on where things live.

``<storage>/raw`` (labelled training images), ``incoming/dt=<day>`` (a day of arrivals): the input prefixes,
which producers write. Everything else only rayline writes; the state it reads back, Train checkpoints and
Tune experiments (Tune unpickles their state on resume), lives under ``RAYLINE_CHECKPOINTS`` (default
``<storage>/checkpoints``), which may not overlap an input prefix. The Delta tables ``predictions`` and
``prediction_errors`` are partitioned by ``model_name`` and ``dt`` (two models' nights of one day never
collide), ``labels`` by ``model_name``.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from rayline import storage
from rayline.config import get_settings
from rayline.errors import ConfigError, InputDataError
from rayline.specs import check_model_name

RAW_DIR = "raw"
INCOMING_DIR = "incoming"
# what producers write into (the IAM split in the README): no state rayline reads back may live under them
INPUT_DIRS = (RAW_DIR, INCOMING_DIR)
CHECKPOINTS_DIR = "checkpoints"  # under the storage root, unless RAYLINE_CHECKPOINTS names a prefix
TRAINING_DIR = "training"
TUNING_DIR = "tuning"
PREDICTIONS_TABLE = "predictions"
ERRORS_TABLE = "prediction_errors"
SHADOW_TABLE = "shadow_predictions"  # a shadow version's rows, scored in the same pass as the night's
LABELS_TABLE = "labels"  # people's answers for predicted photos, partitioned by model_name (rayline.tables.labels)
LABEL_IMPORTS_DIR = "label_imports"  # each import's rows refused and why: <model>/<import id>/rejected.csv
LABELLED_DIR = "labelled"  # the labelled photos as training input: <model>/gen-<fence>-<id>/<class>/<file>
LABEL_QUEUES_DIR = "label_queues"  # what to label next: <model>/dt=<night>/
MONITORING_DIR = "monitoring"
# Runs' scratch space (a night's listing parts, its lease): hidden from listings of the root.
STAGING_DIR = "_staging"
# prepare-data's outputs: ingested/<dataset-id>/, preprocessed/<dataset-id>-<params>/
INGESTED_DIR = "ingested"
PREPROCESSED_DIR = "preprocessed"
# A training run's folder (under training/): Ray Train's checkpoints, and the result of the fit that finished there.
TRAIN_STATE_FILE = "train_state.pt"
TRAIN_RESULT_FILE = "train_result.json"
# The registry: models/<name>/v<N>/ (version.json written last; weights, samples, predictions/, plans/,
# code/, _claim), models/<name>/aliases/<alias>.json and models/<name>/rollout.lease (rayline.models.registry).
MODELS_DIR = "models"
VERSION_FILE = "version.json"
WEIGHTS_FILE = "weights.pt"  # a tensors-only state dict: a version's, and a training checkpoint's
SAMPLES_FILE = "samples.npy"
CLAIM_FILE = "_claim"
ALIASES_DIR = "aliases"
ROLLOUT_LEASE = "rollout.lease"
PLANS_DIR = "plans"  # a version's execution plans, one per machine (rayline.ray_workloads.execution.cache)
CODE_DIR = "code"  # a factory model's package, stored with its version
PREDICTIONS_DIR = "predictions"  # a version's answers on test splits, image by image (rayline.models.split_answers)
# lineage/<stage>/ records, and lineage/openlineage/ events of the default transport
LINEAGE_DIR = "lineage"
OPENLINEAGE_DIR = "openlineage"
MLFLOW_ARTIFACTS_DIR = "mlflow-artifacts"  # the MLflow server `rayline up` starts


def root_uri() -> str:
    """The configured storage root, normalized: where every name here lives (from settings; reads no storage)."""
    return storage.storage_root()


def under_root(*parts: str) -> str:
    """``<storage root>/<parts>``: e.g. ``under_root(RAW_DIR)``, the labelled training images."""
    return storage.join(storage.storage_root(), *parts)


def checkpoints_root() -> str:
    """Where Train checkpoints and Tune experiments live: ``RAYLINE_CHECKPOINTS``, else ``<storage>/checkpoints``.
    Refused (:class:`ConfigError`) when it overlaps an input prefix: Tune unpickles what it finds there."""
    configured = get_settings().checkpoints
    root = storage.normalize(configured) if configured else under_root(CHECKPOINTS_DIR)
    for name in INPUT_DIRS:
        if _overlap(root, under_root(name)):
            raise ConfigError(
                f"RAYLINE_CHECKPOINTS {root!r} overlaps the input prefix {under_root(name)!r}, which producers "
                "write: Tune would unpickle what they put there. Name a prefix apart from <storage>/raw and "
                "<storage>/incoming (default <storage>/checkpoints)"
            )
    return root


def checkpoints_uri(*parts: str) -> str:
    """``<checkpoints root>/<parts>``: e.g. ``checkpoints_uri(TUNING_DIR)``, the Tune experiments."""
    return storage.join(checkpoints_root(), *parts)


def check_input_apart_from_checkpoints(uri: str, what: str) -> None:
    """Refuse an input prefix (a training source, say) that overlaps the checkpoints: its producers could
    write the state rayline reads back."""
    root = checkpoints_root()
    if _overlap(storage.normalize(uri), root):
        raise ConfigError(
            f"{what} {uri!r} overlaps the checkpoints prefix {root!r} (RAYLINE_CHECKPOINTS): whoever writes "
            "an input must not be able to write the state rayline reads back; read inputs from elsewhere"
        )


def _overlap(a: str, b: str) -> bool:
    """Whether one prefix holds the other (by whole path segments: ``raw`` does not hold ``raw-2``)."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def metrics_uri(root: str, model: str) -> str:
    """``<root>/monitoring/<model>.prom``: one file per model in one flat folder, what node-exporter's
    textfile collector reads (``*.prom``)."""
    return storage.join(root, MONITORING_DIR, f"{model}.prom")


def staging_uri(root: str, *parts: str) -> str:
    """``<root>/_staging/<parts>``: e.g. ``staging_uri(root, "nights", model, "dt=…", "listing")``."""
    return storage.join(storage.normalize(root), STAGING_DIR, *parts)


def partition_for(day: date) -> str:
    return f"dt={day.isoformat()}"


def table_uri(root: str, name: str) -> str:
    """``<root>/<name>``: where a Delta table lives (``PREDICTIONS_TABLE``, ``ERRORS_TABLE``, ``LABELS_TABLE``)."""
    return storage.join(storage.normalize(root), name)


def model_name(text: str) -> str:
    """A registered model's name as a partition value: checked like any registry name."""
    return check_model_name(text.strip())


def parse_day(text: str, what: str = "date") -> date:
    try:
        return datetime.strptime(text, "%Y-%m-%d").date()
    except ValueError as exc:
        raise InputDataError(f"{what} must look like 2026-11-28, got {text!r}") from exc


def yesterday_utc() -> date:
    return (datetime.now(UTC) - timedelta(days=1)).date()
