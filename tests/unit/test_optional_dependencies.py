"""The core (nights, serving, the CLI) without the extras: no MLflow, scikit-learn or matplotlib.

A subprocess hides those packages from the import system (a meta path finder
that refuses them), as an install of ``rayline`` without extras would, then
imports every module of the core's paths and runs what meets each missing
package: each either does without it or says which extra brings it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.unit

HIDDEN = ("mlflow", "sklearn", "matplotlib")

PROGRAM = textwrap.dedent(
    f"""
    import importlib, importlib.abc, os, pkgutil, sys

    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {HIDDEN!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Hidden())
    core = ["rayline.cli.main"]
    core += [f"rayline.flows.{{m}}" for m in ("nightly_inference", "serve_rollout", "register_model", "monitor")]
    core += [f"rayline.tasks.{{m}}" for m in ("batch_inference", "serve", "monitoring", "outside_models")]
    for package in ("nightly", "serving", "execution", "data", "architectures", "monitoring"):
        package = f"rayline.ray_workloads.{{package}}"
        module = importlib.import_module(package)
        core += [f"{{package}}.{{m.name}}" for m in pkgutil.iter_modules(module.__path__)]
    for name in core:
        importlib.import_module(name)
    assert not any(m.split(".")[0] in {HIDDEN!r} for m in sys.modules), "an extra was imported"

    from rayline.errors import ConfigError
    from rayline.models import tracking
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    assert tracking.tracking_uri() is None
    os.environ["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:5000"
    try:
        tracking.tracking_uri()
    except ConfigError as exc:
        assert "pip install '.[mlflow]' from rayline's clone" in str(exc), exc
    else:
        raise AssertionError("tracking asked for, MLflow absent: no error")
    from rayline import seed
    try:
        seed.source_photos()
    except ConfigError as exc:
        assert "pip install '.[train]' from rayline's clone" in str(exc), exc
    else:
        raise AssertionError("the demo's photos without scikit-learn: no error")
    from rayline.ray_workloads.monitoring.charts import distribution_png
    assert distribution_png(None) is None  # the monitor's artifact is its table alone
    print("ok")
    """
)


def test_the_core_runs_without_mlflow_scikit_learn_or_matplotlib() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]


def test_a_version_without_samples_and_without_stand_ins_runs_fp32_eager(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without scikit-learn there are no stand-in photos: the plan cannot be judged, so there is none."""
    import numpy as np

    from rayline.errors import ConfigError
    from rayline.models import registry
    from rayline.ray_workloads.execution import cache
    from rayline.specs import ModelSpec, squash

    def no_scikit_learn(*_: object) -> np.ndarray:
        raise ConfigError("the demo's data needs scikit-learn: pip install '.[train]' from rayline's clone")

    monkeypatch.setattr(cache, "_stand_in_photos", no_scikit_learn)
    version = registry.register("bare", b"\\0", model_spec=ModelSpec(num_classes=2), image_spec=squash(32),
                                classes=["a", "b"], metrics={}, code_version="test")  # fmt: skip
    assert cache.probe_set(version, squash(32)) is None
    night = np.ones((3, 3, 32, 32), dtype=np.float32)
    assert np.array_equal(cache.probe_set(version, squash(32), night), night)
