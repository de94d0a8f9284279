"""`rayline demo` (what `make demo` runs) and CLI input checking, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

RAYLINE = str(Path(sys.executable).parent / "rayline")


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RAYLINE_")}
    full_env.update(env)
    return subprocess.run([RAYLINE, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600)


def test_demo_on_embedded_defaults(tmp_path: Path, prefect_api: str) -> None:
    done = _run(["demo"], tmp_path, PREFECT_API_URL=prefect_api)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "prepare-data finished" in out
    assert "objects ingested   1801" in out
    assert "train 1447, val 175, test 175" in out
    assert "errors             4" in out
    assert "train-model finished" in out
    assert "4 trials" in out and "stopped early" in out
    accuracy = float(out.split("test accuracy")[1].split()[0])
    assert accuracy >= 0.95, out
    assert "baseline: first champion" in out
    assert "registered         digits v2: test_accuracy" in out and "alias              challenger" in out
    data = tmp_path / "rayline-data"
    assert (data / "models" / "digits" / "v2" / "weights.pt").is_file()
    assert "serving v1 at http://127.0.0.1:" in out and "rolling out v2 under load" in out
    assert "serve-rollout finished" in out and "v2 passed 3 steps and is champion" in out
    load = out.split("load during the rollout: ")[1].splitlines()[0]
    sent = int(load.split()[0])
    assert sent > 50 and f"(200: {sent})" in load and load.endswith("connection errors: 0"), load
    assert "nightly-inference finished" in out
    assert "1803 inputs → 1799 predictions + 4 errors with digits v2" in out
    assert len(list(data.glob("predictions/dt=*/_SUCCESS"))) == 1
    assert (data / "lineage" / "ingest").is_dir() and (data / "lineage" / "preprocess").is_dir()
    assert len(list(data.glob("preprocessed/*/manifest.json"))) == 1


def test_bad_storage_setting_is_named(tmp_path: Path) -> None:
    done = _run(["seed-data", "--to", "gs://nope/raw"], tmp_path)
    assert done.returncode == 2
    assert "unsupported storage URI 'gs://nope/raw'" in done.stderr
    done = _run(["prepare-data"], tmp_path, RAYLINE_STORAGE="ftp://host/x")
    assert done.returncode == 2
    assert "invalid rayline settings: storage" in done.stderr
