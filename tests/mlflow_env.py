"""A virtualenv with nothing of rayline in it, for the MLflow model's test: what a mirrored model declares.

Every mirrored version's ``requirements.txt`` is ``mlflow_models.pip_requirements()`` (mlflow-skinny, ONNX
Runtime, numpy, pandas, Pillow, pinned). This environment is those packages alone, installed by pip from the
package index into ``.tools/mlflow-env/<key>`` (git-ignored), one folder per set of pins, made once (about 40 s
and 400 MB) and reused; a folder for older pins is removed. The suite runs where only the loopback exists, so
``make suite`` makes it first (``python -m tests.mlflow_env``); a test that finds none says so.

:func:`predict_in` and :func:`model_server` run MLflow there, from a folder of its own (not the repository,
whose ``rayline`` would be importable from the working folder), with the environment's ``bin`` first on
``PATH`` as an activated virtualenv has it (``mlflow models serve`` starts ``uvicorn`` by name).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rayline.ray_workloads.registration import mlflow_models
from tests.support import REPO_ROOT, free_port, stop_process, wait_for_http

ROOT = REPO_ROOT / ".tools" / "mlflow-env"
READY = "ready"  # written last: a folder without it is half-made
SERVER_LOG = "mlflow-serve.log"


def requirements() -> list[str]:
    return mlflow_models.pip_requirements()


def folder(pins: list[str]) -> Path:
    """Where the environment for ``pins`` (and this Python's version) lives."""
    what = "\n".join([f"python {sys.version_info.major}.{sys.version_info.minor}", *sorted(pins)])
    return ROOT / hashlib.sha256(what.encode()).hexdigest()[:16]


def python(pins: list[str]) -> Path | None:
    """The environment's interpreter, if it is made."""
    where = folder(pins)
    return where / "bin" / "python" if (where / READY).exists() else None


def make(pins: list[str]) -> Path:
    """The environment's interpreter, made first if it is not (this needs the package index)."""
    made = python(pins)
    if made is not None:
        return made
    where = folder(pins)
    for other in ROOT.glob("*"):  # a half-made one, and those of older pins
        shutil.rmtree(other, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *pins], check=True)
    (where / READY).write_text("\n".join(pins) + "\n")
    return where / "bin" / "python"


# run in the environment: load the model as a user would, predict one photo, say what it answered
LOAD_AND_PREDICT = textwrap.dedent(
    """
    import importlib.util, json, sys
    import mlflow.pyfunc, pandas as pd
    absent = [name for name in ("rayline", "torch", "torchvision") if importlib.util.find_spec(name)]
    assert not absent, f"not a clean environment: {absent} importable"
    model = mlflow.pyfunc.load_model(sys.argv[1])
    with open(sys.argv[2], "rb") as photo:
        row = model.predict(pd.DataFrame({"image": [photo.read()]})).iloc[0]
    signature = model.metadata.signature
    print(json.dumps({
        "class_index": int(row["class_index"]), "class_name": row["class_name"], "confidence": float(row["confidence"]),
        "inputs": signature.inputs.to_dict(), "outputs": signature.outputs.input_names(),
    }))
    """
)


def environment(python: Path, tracking_uri: str) -> dict[str, str]:
    """The process environment of an activated virtualenv at ``python``, pointed at ``tracking_uri``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}", "MLFLOW_TRACKING_URI": tracking_uri}


def predict_in(python: Path, model_uri: str, photo: Path, tracking_uri: str) -> dict[str, Any]:
    """``mlflow.pyfunc.load_model(model_uri)``'s answer on ``photo``, and the model's signature, in the environment."""
    done = subprocess.run(
        [str(python), "-c", LOAD_AND_PREDICT, model_uri, str(photo)],
        env=environment(python, tracking_uri), cwd=photo.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


@contextlib.contextmanager
def model_server(python: Path, model_uri: str, tracking_uri: str, folder: Path) -> Iterator[str]:
    """``mlflow models serve`` of ``model_uri`` in the environment (its own packages: ``--env-manager local``) on a
    free loopback port, started: yields its address at once (:func:`wait_until_serving` waits), stops it by PID."""
    port = free_port()
    command = [
        str(python), "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with (folder / SERVER_LOG).open("ab") as log:
        proc = subprocess.Popen(
            command, env=environment(python, tracking_uri), cwd=folder, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def wait_until_serving(url: str, folder: Path) -> None:
    try:
        wait_for_http(f"{url}/ping", timeout_s=300)
    except Exception as exc:  # refused or timed out: the server's log says why
        log = (folder / SERVER_LOG).read_text(errors="replace")[-3000:]
        raise AssertionError(f"`mlflow models serve` did not answer /ping: {log}") from exc


if __name__ == "__main__":
    began = time.monotonic()
    pins = requirements()
    ready = python(pins)
    made = ready or make(pins)
    print(f"MLflow model environment ({' '.join(pins)}): {made}, {'reused' if ready else 'made'} in "
          f"{time.monotonic() - began:.0f} s")  # fmt: skip
