"""CLI input checking, as a user meets it. (The demo itself runs in test_platform, against `rayline up`.)"""

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


def test_bad_storage_setting_is_named(tmp_path: Path) -> None:
    done = _run(["seed-data", "--to", "hdfs://nope/raw"], tmp_path)
    assert done.returncode == 3
    assert "unsupported storage URI 'hdfs://nope/raw': use a local path, s3://bucket[/prefix]" in done.stderr
    done = _run(["prepare-data"], tmp_path, RAYLINE_STORAGE="ftp://host/x")
    assert done.returncode == 3
    assert "invalid rayline settings: RAYLINE_STORAGE: " in done.stderr


@pytest.mark.parametrize(
    ("uri", "form"),
    [
        ("s3:/bucket/raw", "s3://bucket[/prefix]"),
        ("s3://", "s3://bucket[/prefix]"),
        ("az:/c/x", "az://container[/prefix]"),
    ],
)
def test_a_mistyped_cloud_uri_is_refused_with_the_expected_form_and_nothing_written(
    tmp_path: Path, uri: str, form: str
) -> None:
    done = _run(["seed-data", "--to", uri], tmp_path)
    assert done.returncode == 3, done.stdout
    assert f"{uri!r}" in done.stderr and f"expected {form}" in done.stderr
    assert list(tmp_path.iterdir()) == [], "nothing written to local disk"


def test_json_is_the_whole_of_stdout_even_for_a_flow(tmp_path: Path) -> None:
    """A flow's command with --json: Prefect's and the CLI's own lines go to stderr, stdout is the result."""
    import json

    import torch
    import torchvision

    weights = tmp_path / "tiny.pt"
    torch.save(torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=2).state_dict(), weights)
    (tmp_path / "classes.txt").write_text("cat\ndog\n")
    args = ["register-model", "--name", "tiny", "--arch", "mobilenet_v3_small", "--weights", str(weights),
            "--classes", str(tmp_path / "classes.txt"), "--json"]  # fmt: skip
    done = _run(args, tmp_path, RAYLINE_STORAGE=str(tmp_path / "storage"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["version"]["version"] == 1 and result["version"]["classes"] == ["cat", "dog"]
    assert result["reused"] is False
