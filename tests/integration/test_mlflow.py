"""MLflow tracking and the registry mirror, against a real ``mlflow server`` on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

from flows.train_model import train_model
from rayline import storage
from rayline.models import mlflow_mirror, registry
from rayline.seed import seed
from tests.integration.helpers import register_untrained
from tests.mlflow_support import mlflow_server
from tests.support import free_port

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture
def tracking(mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> MlflowClient:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    return MlflowClient(mlflow_uri)


def _dead_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def _runs(client: MlflowClient, experiment: str, stage: str) -> list:  # type: ignore[type-arg]
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment}"
    return list(client.search_runs([found.experiment_id], filter_string=f"tags.`rayline.stage` = '{stage}'"))


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _assert_mirror_equals_registry(client: MlflowClient, name: str) -> None:
    """One MLflow version per rayline version (its weights file, tensors only) and the same aliases."""
    mirrored = mlflow_mirror.mirrored_versions(client, name)
    assert sorted(mirrored) == [v.version for v in registry.list_versions(name)]
    for number, mv in mirrored.items():
        version = registry.get_version(name, number)
        files = [f.path for f in client.list_artifacts(mv.run_id, "weights")]
        assert files == ["weights/weights.pt"], "the tensors-only state dict, no pickled model"
        local = download_artifacts(artifact_uri=f"{mv.source}/weights.pt")
        state = torch.load(local, weights_only=True)  # refuses anything but tensors
        assert Path(local).read_bytes() == storage.read_bytes(version.weights_uri)
        assert set(state) and all(isinstance(t, torch.Tensor) for t in state.values())
        assert client.get_run(mv.run_id).data.metrics == pytest.approx(version.metrics)
    aliases = client.get_registered_model(name).aliases
    for alias in mlflow_mirror.ALIASES:
        number = registry.alias_version(name, alias)
        assert aliases.get(alias) == (mirrored[number].version if number is not None else None), alias


@pytest.mark.usefixtures("ray_session", "prefect_api")
def test_train_model_logs_trials_run_and_version_and_a_dead_server_fails_nothing(
    local_storage: str, tracking: MlflowClient, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(storage.join(local_storage, "raw"))
    name = "mlf-train"
    params = {"model_name": name, "epochs": 2, "num_workers": 1, "floor": 0.0, "tune_samples": 2, "tune_max_epochs": 2}
    first = train_model(**params)

    # Tune: one run per trial (sampled config as params, each epoch's report), under the search's parent run
    searched = first.tuned
    assert searched is not None
    (parent,) = _runs(tracking, name, "tune")
    trials = _runs(tracking, name, "tune-trial")
    assert len(trials) == 2
    for run in trials:
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert {"lr", "batch_size", "width", "arch", "weight_decay"} <= set(run.data.params)
        (summary,) = [t for t in searched.trials if run.info.run_name.endswith(t.trial_id)]
        assert _steps(tracking, run.info.run_id, "val_accuracy") == list(range(1, summary.epochs + 1))

    # Train: params, per-epoch metrics, the curves and the evaluation in one run
    (trained,) = _runs(tracking, name, "train")
    assert trained.data.params["loop.lr"] == str(searched.best_config.lr)
    assert _steps(tracking, trained.info.run_id, "val_accuracy") == [0, 1]
    assert _steps(tracking, trained.info.run_id, "train_loss") == [0, 1]
    ended = [m.timestamp / 1000 for m in tracking.get_metric_history(trained.info.run_id, "val_accuracy")]
    assert all(abs(t - time.time()) < 3600 for t in ended), f"points stamped when their epoch ended: {ended}"
    assert "epoch_ended_at" not in trained.data.metrics  # a time, not a metric
    assert trained.data.metrics["test_accuracy"] == pytest.approx(first.evaluation.accuracy)
    assert "test_recall.7" in trained.data.metrics
    artifacts = {f.path for f in tracking.list_artifacts(trained.info.run_id)}
    assert "curves.png" in artifacts
    assert {f.path for f in tracking.list_artifacts(trained.info.run_id, "evaluation")} == {
        "evaluation/evaluation.json",
        "evaluation/confusion.png",
    }

    # the registry: v1 (champion) mirrored
    assert registry.alias_version(name, registry.CHAMPION) == 1
    _assert_mirror_equals_registry(tracking, name)

    # MLflow down: the same flow completes (v2 registered), the mirror lags behind …
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _dead_uri())
    second = train_model(**params)
    assert second.registration.version.version == 2
    assert sorted(mlflow_mirror.mirrored_versions(tracking, name)) == [1]
    # … and the next reconcile (any registration, alias move, train or monitor run) catches up
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    report = mlflow_mirror.reconcile(name)
    assert report is not None and report.created == [2]
    _assert_mirror_equals_registry(tracking, name)


def test_alias_moves_are_mirrored_and_a_failed_mirror_is_completed_later(
    local_storage: str, tracking: MlflowClient, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "mlf-mirror"
    first = register_untrained(name, seed=1)
    registry.set_alias(name, registry.CHAMPION, first.version, "test")
    report = mlflow_mirror.reconcile(name)
    assert report is not None and report.created == [1] and report.aliases == {"champion": 1, "challenger": None}
    _assert_mirror_equals_registry(tracking, name)
    assert mlflow_mirror.reconcile(name) == report.model_copy(update={"created": []}), "idempotent"

    second = register_untrained(name, seed=2)
    registry.set_alias(name, registry.CHALLENGER, second.version, "test")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _dead_uri())
    assert mlflow_mirror.reconcile(name) is None, "a failed mirror is logged, never raised"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    assert mlflow_mirror.reconcile(name) is not None
    _assert_mirror_equals_registry(tracking, name)

    registry.set_alias(name, registry.CHAMPION, second.version, "canary passed")  # challenger promoted
    mlflow_mirror.reconcile(name)
    _assert_mirror_equals_registry(tracking, name)
    assert (
        tracking.get_registered_model(name).aliases["champion"]
        == tracking.get_registered_model(name).aliases["challenger"]
    )
