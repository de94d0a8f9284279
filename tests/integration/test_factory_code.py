"""A version's shipped factory code on Ray: the registered code builds the model on the driver and on a worker.

Ray puts the driver's working folder first on its workers' ``sys.path``
(ahead of a runtime env's ``py_modules`` and ``PYTHONPATH``), so a user who
runs a driver from a checkout holding a same-named package (their working
copy, an older version) gives it to every worker. A driver of its own joins
the session's cluster from such a folder, builds the version's model there
and in a Ray task, and says which copy of the package built each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from rayline import storage
from tests.factory_code_support import ship, write_package
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

PACKAGE = "ownnet_on_ray"  # written by this test only: importable nowhere else

DRIVER = """
import json, sys
import ray
from rayline.ray_workloads.architectures import factory_models
from rayline.specs import FactoryRef

ref = FactoryRef.model_validate_json(sys.argv[1])


def origin() -> str:
    return str(factory_models.build(ref, 3).origin)


ray.init(namespace="rayline")
options = {"num_cpus": 0, "max_retries": 0}
env = factory_models.runtime_env(ref)
if env:
    options["runtime_env"] = env
print(json.dumps({"driver": origin(), "worker": ray.get(ray.remote(origin).options(**options).remote())}))
"""


def test_a_same_named_package_in_the_drivers_folder_does_not_build_the_version_on_the_driver_or_a_worker(
    local_storage: str, tmp_path: Path
) -> None:
    ref = ship(storage.join(local_storage, "models", "own"), tmp_path, PACKAGE, "registered")
    project = tmp_path / "project"
    write_package(project, PACKAGE, "planted")
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": "token",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, ref.model_dump_json()],
        cwd=project, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"driver": "registered", "worker": "registered"}
