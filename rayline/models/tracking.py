"""MLflow tracking: Train runs, their evaluation, and what the registry mirror builds on.

Tracking is on when ``MLFLOW_TRACKING_URI`` is set (MLflow's own variable; ``rayline up`` sets it for the flow runs its
worker starts). Everything here is best effort: rayline's storage and registry are the record, MLflow a view of them for
comparing runs. No function raises for an MLflow problem (server down, wrong URI, refused write): it logs a warning and
returns ``None``, and every write is keyed by a ``rayline.*`` tag, so the next call completes what a failed one left out
instead of duplicating it.

Tune trials are logged by Ray's own ``MLflowLoggerCallback`` (``rayline.ray_workloads.training.tune``).
"""

from __future__ import annotations

import importlib
import logging
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayline.errors import ConfigError
from rayline.extras import install_hint

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
RUN_KEY_TAG = "rayline.run_uri"  # the storage folder a run is about: its identity across retries
STAGE_TAG = "rayline.stage"
_HEALTH_TIMEOUT_S = 3.0


def tracking_uri() -> str | None:
    """The MLflow tracking server, or None when tracking is off; ``ConfigError`` when it is set but MLflow's
    client (the ``rayline[mlflow]`` extra) is not installed."""
    uri = os.environ.get(TRACKING_URI_ENV, "").strip() or None
    if uri is not None:
        try:
            importlib.import_module("mlflow")  # what every caller of a set URI imports next
        except ImportError as exc:
            raise ConfigError(
                f"{TRACKING_URI_ENV} is {uri}, but MLflow is not installed: {install_hint('mlflow')}, "
                f"or unset {TRACKING_URI_ENV} to run without tracking"
            ) from exc
    return uri


def reachable(uri: str) -> bool:
    """A quick look at an HTTP server's ``/health`` before writing: a stopped server fails in
    seconds here instead of after the MLflow client's retries."""
    if not uri.startswith(("http://", "https://")):
        return True  # a local file/sqlite store: nothing to reach
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=_HEALTH_TIMEOUT_S):
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def client() -> MlflowClient | None:
    """A client of the tracking server, or None (tracking off, or the server does not answer)."""
    uri = tracking_uri()
    if uri is None:
        return None
    if not reachable(uri):
        log.warning("MLflow at %s does not answer; tracking skipped this time", uri)
        return None
    # MLflow draws a tqdm bar on stderr for every artifact it moves, even a one-file registration;
    # rayline's terminal stays its own progress lines (an explicit setting wins)
    os.environ.setdefault(PROGRESS_BAR_ENV, "false")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(mlflow: MlflowClient, name: str) -> str:
    """The experiment ``name``, created on first use."""
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow.create_experiment(name))
    except MlflowException:  # created meanwhile by a concurrent run
        again = mlflow.get_experiment_by_name(name)
        if again is None:
            raise
        return str(again.experiment_id)


def keyed_run(
    mlflow: MlflowClient, experiment: str, key: str, run_name: str, tags: Mapping[str, str] | None = None
) -> str:
    """The run of ``experiment`` tagged with ``key`` (a storage URI), created if there is none yet."""
    exp = experiment_id(mlflow, experiment)
    quoted = key.replace("'", "\\'")
    found = mlflow.search_runs([exp], filter_string=f"tags.`{RUN_KEY_TAG}` = '{quoted}'", max_results=1)
    if found:
        return str(found[0].info.run_id)
    run = mlflow.create_run(exp, run_name=run_name, tags={RUN_KEY_TAG: key, **(tags or {})})
    return str(run.info.run_id)


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config → MLflow params (``model.width``); None values are left out."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif value is not None:
            flat[name] = str(value)[:6000]  # MLflow's limit on a param value
    return flat


def log_params(mlflow: MlflowClient, run_id: str, params: Mapping[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        mlflow.log_batch(run_id, params=items[start : start + 100])


def log_steps(
    mlflow: MlflowClient,
    run_id: str,
    steps: list[dict[str, float]],
    step_key: str = "epoch",
    time_key: str = "epoch_ended_at",
) -> None:
    """One metric point per key and step, stamped with the step's ``time_key`` (seconds since the epoch),
    which is not a metric itself; steps already in the run (a retried call) are not logged again."""
    from mlflow.entities import Metric

    if not steps:
        return
    probe = next(k for k in steps[0] if k not in (step_key, time_key))
    done = {m.step for m in mlflow.get_metric_history(run_id, probe)}
    points = [
        Metric(key, float(value), int(row.get(time_key, 0) * 1000), int(row[step_key]))
        for row in steps
        if int(row[step_key]) not in done
        for key, value in row.items()
        if key not in (step_key, time_key)
    ]
    for start in range(0, len(points), 1000):
        mlflow.log_batch(run_id, metrics=points[start : start + 1000])


def log_metrics(mlflow: MlflowClient, run_id: str, metrics: Mapping[str, float]) -> None:
    from mlflow.entities import Metric

    now = 0  # fixed timestamp and step: logging the same figures again adds no second point
    mlflow.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])


def log_files(mlflow: MlflowClient, run_id: str, files: Mapping[str, bytes], artifact_path: str | None = None) -> None:
    """Write ``files`` (name → bytes) as the run's artifacts (a retry overwrites them)."""
    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            path = Path(folder) / name
            path.write_bytes(data)
            mlflow.log_artifact(run_id, str(path), artifact_path)


@contextmanager
def best_effort(what: str) -> Iterator[None]:
    """Log, never raise: MLflow is a mirror of rayline's records."""
    try:
        yield
    except Exception as exc:  # any MLflow/HTTP/storage problem only costs the mirror
        log.warning("MLflow: %s failed (%s: %s); the next run retries it", what, type(exc).__name__, exc)


def log_training(
    experiment: str,
    run_uri: str,
    run_name: str,
    params: Mapping[str, Any],
    history: list[dict[str, float]],
    files: Mapping[str, bytes],
) -> str | None:
    """A Train run as an MLflow run: params, per-epoch metrics (step = epoch), files (the curves)."""
    mlflow = client()
    if mlflow is None:
        return None
    with best_effort(f"logging training run {run_name}"):
        run_id = keyed_run(mlflow, experiment, run_uri, run_name, {STAGE_TAG: "train"})
        log_params(mlflow, run_id, flatten(params))
        log_steps(mlflow, run_id, history)
        log_files(mlflow, run_id, files)
        mlflow.set_terminated(run_id, "FINISHED")
        return run_id
    return None


def log_evaluation(
    experiment: str, run_uri: str, run_name: str, metrics: Mapping[str, float], files: Mapping[str, bytes]
) -> str | None:
    """The evaluation of a Train run, into that run (found by ``run_uri``)."""
    mlflow = client()
    if mlflow is None:
        return None
    with best_effort(f"logging the evaluation of {run_name}"):
        run_id = keyed_run(mlflow, experiment, run_uri, run_name, {STAGE_TAG: "train"})
        log_metrics(mlflow, run_id, metrics)
        log_files(mlflow, run_id, files, "evaluation")
        return run_id
    return None


def finish_run(experiment: str, run_uri: str, run_name: str, metrics: Mapping[str, float]) -> str | None:
    """Log a run's summary metrics and mark it finished (a Tune search's parent run, say)."""
    mlflow = client()
    if mlflow is None:
        return None
    with best_effort(f"finishing run {run_name}"):
        run_id = keyed_run(mlflow, experiment, run_uri, run_name)
        log_metrics(mlflow, run_id, metrics)
        mlflow.set_terminated(run_id, "FINISHED")
        return run_id
    return None
