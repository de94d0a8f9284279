"""A real MLflow tracking server on loopback for the tests, stopped by PID like the S3 server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
