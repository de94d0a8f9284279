"""A real MLflow tracking server on loopback for the tests, stopped by PID like the S3 server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.models import Model

from rayline import storage
from rayline.models import mlflow_mirror, registry
from rayline.storage import layout
from tests.support import free_port, stop_process, wait_for_http


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """``mlflow server`` (SQLite and artifacts under ``folder``) on a free port; yields its URI.

    The same command as ``rayline up`` runs (``platform.mlflow_command``), as a module of this
    interpreter: ``python -m mlflow`` works wherever the package is installed.
    """
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination", str(folder / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with (folder / "server.log").open("ab") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{uri}/health", timeout_s=120)
        yield uri
    finally:
        stop_process(proc)


def dead_uri() -> str:
    """An MLflow tracking URI nothing listens at: a server that is down."""
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def runs_of(client: MlflowClient, experiment: str, stage: str) -> list:  # type: ignore[type-arg]
    """The runs of ``experiment`` that rayline tagged with ``stage`` (tune, tune-trial, train)."""
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment}"
    return list(client.search_runs([found.experiment_id], filter_string=f"tags.`rayline.stage` = '{stage}'"))


def steps_of(client: MlflowClient, run_id: str, key: str) -> list[int]:
    """The steps at which ``key`` was logged in the run, sorted."""
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def assert_mirror_equals_registry(client: MlflowClient, name: str) -> None:
    """One MLflow version per rayline version, each an MLflow pyfunc logged from code (no pickle) whose
    artifacts are the version's own files, and the same aliases."""
    mirrored = mlflow_mirror.mirrored_versions(client, name)
    assert sorted(mirrored) == [v.version for v in registry.list_versions(name)]
    assert not mlflow_mirror.bare_versions(client, name)
    for number, mv in mirrored.items():
        version = registry.get_version(name, number)
        model_file = version.weights_uri.rpartition("/")[2]
        files = {f.path for f in client.list_artifacts(mv.run_id, "model")}
        files |= {f.path for f in client.list_artifacts(mv.run_id, "model/artifacts")}
        assert {"model/MLmodel", "model/mlflow_pyfunc.py", f"model/artifacts/{model_file}"} <= files, files
        assert not [f for f in files if f.endswith((".pkl", ".pickle", ".cloudpickle"))], "no pickled model"
        assert mv.source == f"{client.get_run(mv.run_id).info.artifact_uri}/model"
        flavor = Model.load(download_artifacts(artifact_uri=f"{mv.source}/MLmodel")).flavors["python_function"]
        assert flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model", "models-from-code"
        local = download_artifacts(artifact_uri=f"{mv.source}/artifacts/{model_file}")
        assert Path(local).read_bytes() == storage.read_bytes(version.weights_uri)
        if version.model_spec.format == "state_dict":
            state = torch.load(local, weights_only=True)  # refuses anything but tensors
            assert set(state) and all(isinstance(t, torch.Tensor) for t in state.values())
        logged = download_artifacts(artifact_uri=f"{mv.source}/artifacts/{layout.VERSION_FILE}")
        assert registry.ModelVersion.model_validate_json(Path(logged).read_text()) == version
        assert client.get_run(mv.run_id).data.metrics == pytest.approx(version.metrics)
    aliases = client.get_registered_model(name).aliases
    for alias in mlflow_mirror.ALIASES:
        number = registry.alias_version(name, alias)
        assert aliases.get(alias) == (mirrored[number].version if number is not None else None), alias
