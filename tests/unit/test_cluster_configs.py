"""The cluster configs in deployments/cluster: what rayline relies on, and nothing secret."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.support import REPO_ROOT

pytestmark = pytest.mark.unit

CLUSTER = REPO_ROOT / "deployments" / "cluster"
RAY_VERSION = "2.60.0"
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")


def _render(path: Path) -> dict[str, Any]:
    """The YAML with every ${NAME} replaced by a sample value, as envsubst would."""
    text = PLACEHOLDER.sub(lambda m: f"sample-{m.group(1).lower().replace('_', '-')}", path.read_text())
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


@pytest.fixture(scope="module")
def launcher() -> dict[str, Any]:
    return _render(CLUSTER / "ray-aws.yaml")


@pytest.fixture(scope="module")
def kuberay() -> dict[str, Any]:
    return _render(CLUSTER / "raycluster.yaml")


def test_launcher_config_passes_rays_own_schema(launcher: dict[str, Any]) -> None:
    spec = importlib.util.find_spec("ray")
    assert spec and spec.origin
    schema = json.loads((Path(spec.origin).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(launcher, schema)


def test_launcher_runs_ray_2_60_on_python_3_11_with_rayline_installed(launcher: dict[str, Any]) -> None:
    images = [launcher["docker"]["image"]] + [
        t["docker"]["worker_image"] for t in launcher["available_node_types"].values() if "docker" in t
    ]
    assert images and all(re.fullmatch(rf"rayproject/ray:{RAY_VERSION}-py311(-gpu)?", i) for i in images), images
    (install,) = launcher["setup_commands"]
    assert "-c ~/rayline/constraints.txt ~/rayline" in install
    assert launcher["file_mounts"]["~/rayline"] == "."


def test_launcher_ports_auth_and_autoscaling(launcher: dict[str, Any]) -> None:
    head = " ".join(launcher["head_start_ray_commands"])
    for flag in ("--head", "--port=6379", "--dashboard-port=8265", "--dashboard-host=127.0.0.1"):
        assert flag in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    worker = " ".join(launcher["worker_start_ray_commands"])
    assert "--address=$RAY_HEAD_IP:6379" in worker, "the launcher fills $RAY_HEAD_IP: envsubst must not"
    assert all("RAY_AUTH_MODE=token" in cmd for cmd in (head, worker))
    assert launcher["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"

    types = launcher["available_node_types"]
    assert types[launcher["head_node_type"]]["resources"] == {"CPU": 0}
    workers = {name: t for name, t in types.items() if name != launcher["head_node_type"]}
    assert set(workers) == {"cpu_worker", "gpu_worker"}
    for t in workers.values():
        assert 0 <= t["min_workers"] <= t["max_workers"]
    assert workers["cpu_worker"]["max_workers"] >= 2 and workers["gpu_worker"]["min_workers"] == 0
    assert sum(t["max_workers"] for t in workers.values()) == launcher["max_workers"]
    assert launcher["idle_timeout_minutes"] > 0


def test_raycluster_version_auth_ports_and_autoscaling(kuberay: dict[str, Any]) -> None:
    assert (kuberay["apiVersion"], kuberay["kind"]) == ("ray.io/v1", "RayCluster")
    spec = kuberay["spec"]
    assert spec["rayVersion"] == RAY_VERSION
    assert spec["authOptions"] == {"mode": "token"}
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0

    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and head["rayStartParams"]["num-cpus"] == "0"
    (head_container,) = head["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in head_container["ports"]}
    assert ports["gcs-server"] == 6379 and ports["dashboard"] == 8265 and ports["client"] == 10001
    assert head["rayStartParams"]["dashboard-port"] == str(ports["dashboard"])

    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    for group in groups.values():
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert groups["cpu"]["maxReplicas"] >= 2 and groups["gpu"]["minReplicas"] == 0
    (gpu,) = groups["gpu"]["template"]["spec"]["containers"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"

    pods = [head["template"]["spec"]] + [g["template"]["spec"] for g in groups.values()]
    for pod in pods:
        assert pod["serviceAccountName"] == "sample-rayline-service-account"
        for container in pod["containers"]:
            assert container["image"] in ("sample-rayline-image", "sample-rayline-gpu-image")
            assert container["resources"]["requests"] == container["resources"]["limits"], container["name"]


def test_image_is_ray_2_60_on_python_3_11() -> None:
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"ARG BASE=rayproject/ray:{RAY_VERSION}-py311\n" in dockerfile
    # the stages run on the image: training's extra and MLflow's client (Tune logs its trials from the workers)
    assert "pip install --no-cache-dir -c constraints.txt '.[train,mlflow]'" in dockerfile
    assert f"\nray=={RAY_VERSION}\n" in (REPO_ROOT / "constraints.txt").read_text(), "the version CI proves"
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11"' in pyproject and '"ray[data,serve]>=2.60,<3"' in pyproject


@pytest.mark.parametrize("name", ["ray-aws.yaml", "raycluster.yaml", "Dockerfile", "README.md"])
def test_no_secrets_account_ids_or_buckets(name: str) -> None:
    text = (CLUSTER / name).read_text()
    forbidden = {
        "AWS access key id": r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",
        "AWS account id or ARN": r"\b\d{12}\b|arn:aws",
        "bucket name": r"s3://(?!<bucket>)",
        "literal credential": r"(?i)(secret_access_key|auth_token|password|api_key)\s*[:=]\s*['\"]?[A-Za-z0-9/+]{8,}",
        "private key": r"BEGIN [A-Z ]*PRIVATE KEY",
    }
    for what, pattern in forbidden.items():
        assert not re.search(pattern, text), f"{name} holds a {what}"


def test_every_placeholder_is_documented_and_rendered_by_the_readme() -> None:
    readme = (CLUSTER / "README.md").read_text()
    for name in ("ray-aws.yaml", "raycluster.yaml"):
        text = (CLUSTER / name).read_text()
        used = set(PLACEHOLDER.findall(text))
        assert used, name
        for variable in used:
            assert f"`{variable}`" in readme, f"{variable} of {name} is not documented"
        # the envsubst line in the file's own header names exactly these variables
        (listed,) = re.findall(r"envsubst '([^']+)'", text)
        assert {v.lstrip("$") for v in listed.split()} == used, name
        assert f"envsubst '{listed}'" in readme, f"README renders {name} differently"
