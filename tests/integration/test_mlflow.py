"""The registry's MLflow mirror against a real ``mlflow server`` on loopback (what train-model tracks there is
test_train_model_flow's)."""

from __future__ import annotations

import io
import uuid
import warnings
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import torch
import torchvision
from mlflow import MlflowClient
from PIL import Image

from rayline import storage
from rayline.models import mlflow_mirror, registry
from rayline.ray_workloads.architectures import factory_models
from rayline.ray_workloads.architectures.build import state_dict_bytes
from rayline.ray_workloads.data.images import decode_image
from rayline.ray_workloads.execution import interface
from rayline.ray_workloads.registration import mlflow_models
from rayline.ray_workloads.registration.outside_models import RegisterModelConfig
from rayline.ray_workloads.registration.outside_models import run as register_model
from rayline.specs import FACTORY, FactoryRef, ImageSpec, ModelSpec
from tests.integration.helpers import register_untrained
from tests.mlflow_support import assert_mirror_equals_registry, dead_uri

pytestmark = [pytest.mark.integration]


@pytest.fixture
def tracking(mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> MlflowClient:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    return MlflowClient(mlflow_uri)


def test_alias_moves_are_mirrored_and_a_failed_mirror_is_completed_later(
    local_storage: str, tracking: MlflowClient, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "mlf-mirror"
    first = register_untrained(name, seed=1)
    registry.set_alias(name, registry.CHAMPION, first.version, "test")
    # what an older mirror left: the bare weights file as champion, which nothing can load …
    tracking.create_registered_model(name)
    run = tracking.create_run(tracking.create_experiment("mlf-mirror-old"))
    tracking.log_artifact(run.info.run_id, storage.normalize(first.weights_uri), "weights")
    bare = tracking.create_model_version(
        name, f"{run.info.artifact_uri}/weights", run_id=run.info.run_id, tags={mlflow_mirror.VERSION_TAG: "1"}
    )
    tracking.set_registered_model_alias(name, registry.CHAMPION, bare.version)
    report = mlflow_models.reconcile(name)  # … is replaced by a model, the alias moved, the bare version deleted
    assert report is not None and report.created == [1] and report.aliases == {"champion": 1, "challenger": None}
    remaining = [mv.version for mv in tracking.search_model_versions(f"name = '{name}'")]
    assert remaining == [report.versions[1]] and report.versions[1] != bare.version
    assert_mirror_equals_registry(tracking, name)
    assert mlflow_models.reconcile(name) == report.model_copy(update={"created": []}), "idempotent"

    second = register_untrained(name, seed=2)
    registry.set_alias(name, registry.CHALLENGER, second.version, "test")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead_uri())
    assert mlflow_models.reconcile(name) is None, "a failed mirror is logged, never raised"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    assert mlflow_models.reconcile(name) is not None
    assert_mirror_equals_registry(tracking, name)

    registry.set_alias(name, registry.CHAMPION, second.version, "canary passed")  # challenger promoted
    mlflow_models.reconcile(name)
    assert_mirror_equals_registry(tracking, name)
    assert (
        tracking.get_registered_model(name).aliases["champion"]
        == tracking.get_registered_model(name).aliases["challenger"]
    )


def _photos() -> list[bytes]:
    """Two real photos (scikit-learn's JPEGs), a transparent PNG and a grayscale PNG: what rayline decodes."""
    from sklearn.datasets import load_sample_images

    images = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(0)
    images.append(Image.fromarray(rng.integers(0, 255, (50, 70, 4), dtype=np.uint8), "RGBA"))
    images.append(Image.fromarray(rng.integers(0, 255, (90, 60), dtype=np.uint8), "L"))
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, "JPEG" if image.mode == "RGB" else "PNG")
        encoded.append(buffer.getvalue())
    return encoded


def _onnx_file(path: Path, num_classes: int) -> Path:
    model = torchvision.models.get_model("squeezenet1_1", weights=None, num_classes=num_classes).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript-based exporter's deprecation notices
        torch.onnx.export(
            model, (torch.randn(2, 3, 64, 64),), str(path), dynamo=False, input_names=["images"],
            dynamic_axes={"images": {0: "batch"}},
        )  # fmt: skip
    return path


def _factory_version(name: str, tmp_path: Path, classes: list[str], last: str = "") -> registry.ModelVersion:
    """The user's own class, its package shipped with the version (``--code``), registered without Ray;
    ``last``: a module of the package's own applied to the scores."""
    package = f"mlfnet_{uuid.uuid4().hex[:8]}"  # a fresh name: the code must come from the registered zip
    folder = tmp_path / package
    folder.mkdir()
    (folder / "__init__.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Cumulative(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.cummax(x, dim=1).values\n\n"
        "def build(num_classes):\n"
        "    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),"
        f" nn.Linear(8, num_classes){', ' + last + '()' if last else ''})\n"
    )
    code_uri, sha256 = factory_models.store_code(
        registry.model_root(name), factory_models.zip_code(str(folder), package)
    )
    ref = FactoryRef(target=f"{package}:build", code_uri=code_uri, code_sha256=sha256)
    torch.manual_seed(3)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(8, len(classes)),
    )  # fmt: skip
    return registry.register(
        name,
        state_dict_bytes(module),
        model_spec=ModelSpec(arch=FACTORY, num_classes=len(classes), factory=ref),
        image_spec=ImageSpec(crop=32),
        classes=classes,
        metrics={},
        code_version="test",
    )


def test_mlflow_loads_every_mirrored_version_and_predicts_what_rayline_predicts(
    local_storage: str, tracking: MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, classes = "mlf-pets", ["cat", "dog", "bird"]
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # the factory's code is put on it
    (tmp_path / "classes.txt").write_text("\n".join(classes) + "\n")
    torch.manual_seed(0)  # random weights whose scores still depend on the image (MobileNet's are near-uniform)
    weights = tmp_path / "resnet18.pt"
    weights.write_bytes(state_dict_bytes(torchvision.models.get_model("resnet18", weights=None, num_classes=3)))
    common = {"name": name, "classes": str(tmp_path / "classes.txt"), "crop": 64}
    state_dict = register_model(
        RegisterModelConfig(**common, arch="resnet18", weights_uri=str(weights), alias="champion")
    ).version
    onnx = register_model(  # the format read from the file: a code-free model, run by ONNX Runtime
        RegisterModelConfig(**common, weights_uri=str(_onnx_file(tmp_path / "m.onnx", 3)), alias="challenger")
    ).version
    factory = _factory_version(name, tmp_path, classes)  # exported here, where its code is: none is logged
    unexportable = _factory_version(name, tmp_path, classes, last="Cumulative")  # cummax: no ONNX operator
    assert (state_dict.model_spec.format, onnx.model_spec.format) == ("state_dict", "onnx")
    assert registry.alias_version(name, registry.CHALLENGER) == onnx.version

    report = mlflow_models.reconcile(name)
    assert report is not None and report.created == [1, 2, 3]
    assert list(report.left_out) == [unexportable.version], report
    assert "does not export to ONNX" in report.left_out[unexportable.version]
    assert_mirror_equals_registry(tracking, name, left_out=(unexportable.version,))
    mirrored = mlflow_mirror.mirrored_versions(tracking, name)
    registry.set_alias(name, registry.CHALLENGER, unexportable.version, "test")  # no MLflow version to point at
    assert mlflow_models.reconcile(name) == report.model_copy(
        update={"created": [], "aliases": {**report.aliases, "challenger": None}}
    )
    assert "challenger" not in tracking.get_registered_model(name).aliases
    registry.set_alias(name, registry.CHALLENGER, onnx.version, "test")
    mlflow_models.reconcile(name)

    photos = _photos()
    frame = pd.DataFrame({"image": [*photos, b"not an image"]})
    uris = {
        f"models:/{name}@champion": state_dict,
        f"models:/{name}@challenger": onnx,
        f"models:/{name}/{mirrored[3].version}": factory,
    }
    stored = Path(local_storage).rename(tmp_path / "moved")  # MLflow's models need nothing of rayline's storage
    predicted = {uri: mlflow.pyfunc.load_model(uri).predict(frame, params={"top_k": 3}) for uri in uris}
    stored.rename(local_storage)
    for uri, version in uris.items():
        batch = np.stack([decode_image(photo, version.image_spec) for photo in photos])
        expected = interface.load_version(version).probabilities(batch)
        good, bad = predicted[uri].iloc[: len(photos)], predicted[uri].iloc[-1]
        assert list(good["class_index"]) == [int(i) for i in expected.argmax(axis=1)], uri
        assert list(good["class_name"]) == [classes[int(i)] for i in expected.argmax(axis=1)], uri
        assert list(good["confidence"]) == pytest.approx(list(expected.max(axis=1)), rel=1e-4), uri
        # every class's probability, as rayline's preprocessing and model give it (a resize or a mean off shows)
        ranked = [np.argsort(-row, kind="stable") for row in expected]
        assert [list(top) for top in good["top_classes"]] == [[classes[i] for i in order] for order in ranked], uri
        for got, want, order in zip(good["top_confidences"], expected, ranked, strict=True):
            assert list(got) == pytest.approx(list(want[order]), abs=1e-5), uri
        assert len({tuple(np.round(row, 4)) for row in expected}) == len(photos), "the scores depend on the image"
        assert good["error"].isna().all()
        assert bad["class_index"] == -1 and "UnsupportedFormatError" in bad["error"], bad.to_dict()
