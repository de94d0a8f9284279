"""The shape of the project: layering and no side effects at import."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.unit

PACKAGES = ["rayline", "ray_workloads", "tasks", "flows", "deployments"]


def _modules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}.")]


def test_workloads_never_import_prefect() -> None:
    for path in (REPO_ROOT / "ray_workloads").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "prefect" or n.startswith("prefect.") for n in names), f"{path} imports Prefect"


def test_importing_everything_starts_no_ray_and_writes_nothing(tmp_path: object) -> None:
    modules = [m for p in PACKAGES for m in _modules(p)]
    code = (
        "import importlib, os, ray\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "assert not ray.is_initialized(), 'ray.init at import'\n"
        "assert os.listdir('.') == [], os.listdir('.')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_flow_is_a_prefect_flow() -> None:
    from prefect import Flow

    flows = [
        obj
        for module in _modules("flows")
        for obj in vars(importlib.import_module(module)).values()
        if isinstance(obj, Flow)
    ]
    assert {f.name for f in flows} >= {"prepare-data"}
