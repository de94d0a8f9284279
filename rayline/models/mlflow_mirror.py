"""A mirror of rayline's model registry in MLflow's Model Registry.

rayline's registry (``rayline.models.registry``) stays the source of truth; this module makes MLflow show it:

* one registered model per rayline model name;
* one MLflow model version per rayline version, matched by the ``rayline.version`` tag, never by number (MLflow
  numbers its versions itself). Each is a real MLflow model written by the caller's ``save_model`` under
  ``model/`` in a run of its own (experiment = model name), with the version's metrics. The tasks pass
  ``rayline.ray_workloads.registration.mlflow_models.save_version`` (a pyfunc logged from code over an ONNX file,
  no pickle, that ``mlflow.pyfunc.load_model("models:/<name>@champion")`` loads without rayline): making it
  needs rayline's model interface, which the core may not import, hence the callback. A version an older
  mirror logged as a bare weights file (no ``rayline.model_path`` tag) is replaced, then deleted. A version
  ``save_model`` refuses (:class:`~rayline.errors.ModelExportError`: no such model answers as it does) is left
  out, named in the report and the log, and tried again by the next reconcile;
* the ``champion`` and ``challenger`` aliases on the same versions (none on a version left out).

:func:`reconcile` compares and fixes, so it is idempotent: called after every registration and alias move,
and at the start of training, it completes what an earlier call could not (server down, say). It never raises.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from rayline import storage
from rayline.errors import ModelExportError
from rayline.models import registry, tracking

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion as MlflowVersion

log = logging.getLogger(__name__)

VERSION_TAG = "rayline.version"
ALIASES = (registry.CHAMPION, registry.CHALLENGER)
MODEL_PATH = "model"  # the MLflow model's folder among its run's artifacts
# on a version whose source is an MLflow model; one without it mirrored a bare weights file (before MLmodels)
MODEL_TAG = "rayline.model_path"
# writes a version, given its model file's bytes, as an MLflow model in a new folder; ModelExportError where it cannot
SaveModel = Callable[[registry.ModelVersion, bytes, Path], None]


class MirrorReport(BaseModel):
    """What one reconcile did."""

    name: str
    created: list[int]  # rayline versions that got an MLflow model version now
    versions: dict[int, str]  # rayline version → MLflow version number
    aliases: dict[str, int | None]  # alias → rayline version, as mirrored
    left_out: dict[int, str] = {}  # rayline versions no MLflow model can stand for → why


def reconcile(name: str, save_model: SaveModel) -> MirrorReport | None:
    """Bring MLflow's registered model ``name`` in line with rayline's registry, each new version
    written by ``save_model``; None when tracking is off or the mirror failed (logged; the next
    call retries)."""
    mlflow = tracking.client()
    if mlflow is None:
        return None
    with tracking.best_effort(f"mirroring model {name} into the MLflow registry"):
        return _reconcile(mlflow, name, save_model)
    return None


def _reconcile(mlflow: MlflowClient, name: str, save_model: SaveModel) -> MirrorReport:
    _ensure_registered_model(mlflow, name)
    mirrored = mirrored_versions(mlflow, name)
    created, left_out = [], {}
    for version in registry.list_versions(name):
        if version.version in mirrored:
            continue
        try:
            mirrored[version.version] = _mirror_version(mlflow, version, save_model)
        except ModelExportError as exc:
            log.warning("MLflow mirror: %s v%d is left out: %s", name, version.version, exc)
            left_out[version.version] = str(exc)
            continue
        created.append(version.version)
    aliases = {alias: _mirror_alias(mlflow, name, alias, mirrored) for alias in ALIASES}
    for bare in bare_versions(mlflow, name):  # replaced above by a loadable model, aliases moved already
        mlflow.delete_model_version(name, bare.version)
    versions = {k: v.version for k, v in mirrored.items()}
    return MirrorReport(name=name, created=created, versions=versions, aliases=aliases, left_out=left_out)


def _ensure_registered_model(mlflow: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        mlflow.get_registered_model(name)
    except MlflowException:
        mlflow.create_registered_model(
            name,
            tags={"rayline.registry": registry.model_root(name)},
            description=f"Mirror of rayline's registry at {registry.model_root(name)} (the source of truth).",
        )


def _tagged(mlflow: MlflowClient, name: str) -> list[tuple[int, MlflowVersion]]:
    """(rayline version, MLflow version) for every MLflow version of ``name`` tagged by the mirror, oldest first."""
    found = []
    for mv in sorted(mlflow.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
        tag = (mv.tags or {}).get(VERSION_TAG)
        if tag is not None and tag.isdigit():
            found.append((int(tag), mv))
    return found


def mirrored_versions(mlflow: MlflowClient, name: str) -> dict[int, MlflowVersion]:
    """rayline version number → its MLflow model version (the oldest, should two calls have raced)."""
    found: dict[int, MlflowVersion] = {}
    for number, mv in _tagged(mlflow, name):
        if MODEL_TAG in (mv.tags or {}):
            found.setdefault(number, mv)
    return found


def bare_versions(mlflow: MlflowClient, name: str) -> list[MlflowVersion]:
    """Versions an older mirror made of the weights file alone: nothing can load them, a reconcile replaces them."""
    return [mv for _, mv in _tagged(mlflow, name) if MODEL_TAG not in (mv.tags or {})]


def _mirror_version(mlflow: MlflowClient, version: registry.ModelVersion, save_model: SaveModel) -> MlflowVersion:
    """A run holding the MLflow model and the metrics, and a model version whose source is that model. The model
    is written first: a version ``save_model`` refuses leaves no run behind."""
    model_file = storage.read_bytes(version.weights_uri)
    sha256 = hashlib.sha256(model_file).hexdigest()
    with tempfile.TemporaryDirectory(prefix="rayline-mlflow-") as tmp:
        folder = Path(tmp) / MODEL_PATH
        save_model(version, model_file, folder)
        return _log_version(mlflow, version, sha256, folder)


def _log_version(mlflow: MlflowClient, version: registry.ModelVersion, sha256: str, folder: Path) -> MlflowVersion:
    run_tags = {tracking.STAGE_TAG: "registry", VERSION_TAG: str(version.version)}
    run_id = tracking.keyed_run(mlflow, version.name, version.uri, f"{version.name}-v{version.version}", run_tags)
    params = {
        "model": version.model_spec.model_dump(mode="json"),
        "classes": ",".join(version.classes),
        "code_version": version.code_version,
        "data_content_hash": version.data_content_hash,
        "training_run_uri": version.training_run_uri,
    }
    tracking.log_params(mlflow, run_id, tracking.flatten(params))
    if version.metrics:
        tracking.log_metrics(mlflow, run_id, version.metrics)
    mlflow.log_artifacts(run_id, str(folder), MODEL_PATH)  # a retry overwrites the same files
    mlflow.set_terminated(run_id, "FINISHED")
    source = f"{mlflow.get_run(run_id).info.artifact_uri}/{MODEL_PATH}"
    tags = {
        VERSION_TAG: str(version.version),
        MODEL_TAG: MODEL_PATH,
        "rayline.uri": version.uri,
        "rayline.format": version.model_spec.format,
        "rayline.weights_sha256": sha256,
        **{f"rayline.metric.{k}": f"{v:.6g}" for k, v in version.metrics.items()},
    }
    description = (
        f"rayline {version.name} v{version.version} ({version.model_spec.describe()}, {version.model_spec.format} "
        f"file sha256 {sha256}): load it with mlflow.pyfunc.load_model('models:/{version.name}/<version>') and "
        "predict on a DataFrame with a binary column 'image' (encoded image files); it answers class_index, "
        "class_name, confidence and the top classes. It needs neither rayline nor torch: its requirements.txt "
        "is MLflow, ONNX Runtime, numpy, pandas and Pillow. "
        f"Metrics: {', '.join(f'{k} {v:.4f}' for k, v in version.metrics.items()) or 'none'}."
    )
    # await_creation_for=0: the artifacts are logged already; waiting would only print "Waiting up to 300 seconds"
    return mlflow.create_model_version(
        version.name, source, run_id=run_id, tags=tags, description=description, await_creation_for=0
    )


def _mirror_alias(mlflow: MlflowClient, name: str, alias: str, mirrored: dict[int, MlflowVersion]) -> int | None:
    """Point MLflow's ``alias`` at the version mirroring rayline's; drop it where rayline has none."""
    target = registry.alias_version(name, alias)
    current = mlflow.get_registered_model(name).aliases.get(alias)
    if target is None or target not in mirrored:
        if current is not None:
            mlflow.delete_registered_model_alias(name, alias)
        return None
    wanted = mirrored[target].version
    if str(current) != str(wanted):
        mlflow.set_registered_model_alias(name, alias, wanted)
    return target
