"""A real MLflow tracking server on loopback for the tests, stopped by PID like the S3 server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import onnxruntime as ort
import pytest
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.models import Model

from rayline import storage
from rayline.models import mlflow_mirror, registry
from rayline.ray_workloads.registration import mlflow_models
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


def assert_mirror_equals_registry(client: MlflowClient, name: str, left_out: tuple[int, ...] = ()) -> None:
    """One MLflow version per rayline version (less those ``left_out``), each an MLflow pyfunc logged from code
    (no pickle) over the version's ONNX file, needing neither rayline nor torch; and the same aliases."""
    mirrored = mlflow_mirror.mirrored_versions(client, name)
    assert sorted(mirrored) == [v.version for v in registry.list_versions(name) if v.version not in left_out]
    assert not mlflow_mirror.bare_versions(client, name)
    for number, mv in mirrored.items():
        version = registry.get_version(name, number)
        files = {f.path for f in client.list_artifacts(mv.run_id, "model")}
        artifacts = {f.path for f in client.list_artifacts(mv.run_id, "model/artifacts")}
        assert {"model/MLmodel", "model/mlflow_pyfunc.py", "model/requirements.txt"} <= files, files
        assert artifacts == {f"model/artifacts/{layout.VERSION_FILE}", "model/artifacts/model.onnx"}, artifacts
        assert mv.source == f"{client.get_run(mv.run_id).info.artifact_uri}/model"
        flavor = Model.load(download_artifacts(artifact_uri=f"{mv.source}/MLmodel")).flavors["python_function"]
        assert flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model", "models-from-code"
        requirements = Path(download_artifacts(artifact_uri=f"{mv.source}/requirements.txt")).read_text().split()
        assert requirements == mlflow_models.pip_requirements(), "MLflow, ONNX Runtime, numpy, pandas, Pillow alone"
        onnx = Path(download_artifacts(artifact_uri=f"{mv.source}/artifacts/model.onnx")).read_bytes()
        if version.model_spec.format == "onnx":
            assert onnx == storage.read_bytes(version.weights_uri), "an ONNX version is its own file"
        session = ort.InferenceSession(onnx, providers=["CPUExecutionProvider"])  # a graph, nothing pickled
        assert session.get_inputs()[0].shape[1:] == [3, version.image_spec.size, version.image_spec.size]
        logged = download_artifacts(artifact_uri=f"{mv.source}/artifacts/{layout.VERSION_FILE}")
        assert registry.ModelVersion.model_validate_json(Path(logged).read_text()) == version
        assert client.get_run(mv.run_id).data.metrics == pytest.approx(version.metrics)
    aliases = client.get_registered_model(name).aliases
    for alias in mlflow_mirror.ALIASES:
        number = registry.alias_version(name, alias)
        wanted = mirrored[number].version if number is not None and number in mirrored else None
        assert aliases.get(alias) == wanted, alias
