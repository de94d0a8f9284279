"""Fine-tuning registered outside models on labelled photo crops, and retraining one as the retrain deployment would.

Small on purpose (random weights at a 64 px crop, a few dozen photos, one
one-epoch Ray Train fit per test): these check the wiring — weights, head,
image spec, lineage, gate — not accuracy. The fine-tune of a ResNet-18 made
from the command line is the champion that the retraining test retrains: the
module prepares the photos and fine-tunes it once. The user's own class (its
package shipped by ``--code``, so Train's workers import it from the
version's stored zip) is fine-tuned on the same photos with the same image spec,
so it reuses the prepared data; an ONNX parent is refused before any cluster
time. A timm model's new head is tests/unit/test_fine_tune.py's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import numpy as np
import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler
from typer.testing import CliRunner

from rayline import lineage, storage
from rayline.cli import app
from rayline.deployments.catalog import deployment_table
from rayline.errors import ConfigError
from rayline.flows.train_model import train_model
from rayline.models import registry
from rayline.ray_workloads.architectures.build import load_state_dict
from rayline.ray_workloads.execution.interface import load_version
from rayline.ray_workloads.training.request import TrainRequest
from rayline.seed import seed
from rayline.specs import FACTORY, ParentModel
from rayline.storage.layout import RAW_DIR
from tests.integration.helpers import register_outside

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

PHOTOS = 40
PARENT = "photos-base"
CHILD = "photos-base-ft"


def _seed_photos(root: str) -> str:
    """Labelled photos under their own prefix (not raw/, the digits' default source)."""
    labelled = storage.join(root, "labelled-photos")
    seed(labelled, photos=PHOTOS, digits=False)
    return labelled


@dataclass(frozen=True)
class FineTuned:
    """The module's storage after the command-line fine-tune: its photos, the parent, and what the CLI made."""

    root: str
    labelled: str
    parent: registry.ModelVersion
    output: str
    exit_code: int
    child: registry.ModelVersion | None


@pytest.fixture(scope="module")
def fine_tuned(ray_session: None, prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FineTuned]:
    """Labelled photos and an outside parent in a storage root of the module's, fine-tuned once from the CLI."""
    root = str(tmp_path_factory.mktemp("fine-tune") / "storage")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", root)
        labelled = _seed_photos(root)
        parent = register_outside(PARENT, crop=64)
        args = ["train-model", "--init-from", f"{PARENT}@champion", "--freeze-backbone", "--source", labelled]
        result = CliRunner().invoke(app, [*args, "--epochs", "1", "--floor", "0"])
        # the default name; the floor gated its first version
        child = registry.resolve(CHILD, registry.CHAMPION) if result.exit_code == 0 else None
        yield FineTuned(root, labelled, parent, result.output, result.exit_code, child)


def test_fine_tune_from_the_command_line_registers_a_child_of_the_parent(fine_tuned: FineTuned) -> None:
    parent = fine_tuned.parent
    assert fine_tuned.exit_code == 0, fine_tuned.output
    assert f"fine-tuned from    {PARENT} v1 (head only)" in fine_tuned.output

    child = fine_tuned.child
    assert child is not None
    assert child.version == 1 and child.classes == ["china", "flower"]
    assert child.model_spec.arch == "resnet18" and child.model_spec.num_classes == 2
    assert child.image_spec == parent.image_spec, "prepared and registered with the parent's preprocessing"
    assert child.parent == ParentModel(name=PARENT, version=1, uri=parent.uri, freeze_backbone=True)
    (record,) = [r for r in lineage.read_records("registry") if r.outputs[0].uri == child.uri]
    assert parent.uri in {ref.uri for ref in record.inputs}
    assert "first champion" in record.outputs[0].facets["gate"]["reason"]
    assert not lineage.read_records("tune")

    weights, start = load_state_dict(child.weights_uri), load_state_dict(parent.weights_uri)
    assert tuple(weights["fc.weight"].shape) == (2, 512), "a new head sized to the data's classes"
    for key in ("conv1.weight", "layer4.1.conv2.weight", "bn1.running_mean", "layer4.1.bn2.running_var"):
        assert torch.equal(weights[key], start[key]), f"{key} moved although the backbone was frozen"
    assert tuple(start["fc.weight"].shape) == (1000, 512)


def _render(parameters: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """A trigger's parameter templates with ``{{ event.payload.X }}`` filled in, as Prefect renders them."""
    pattern = re.compile(r"\{\{\s*event\.payload\.(\w+)\s*\}\}")
    return {
        k: pattern.sub(lambda m: str(payload[m.group(1)]), v) if isinstance(v, str) else v
        for k, v in parameters.items()
    }


def _flow_run_logs(flow_run_id: str) -> list[str]:
    APILogHandler().flush()  # logs reach the API in batches

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)]))
            )
        return [log.message for log in logs]

    return asyncio.run(read())


def test_retraining_a_fine_tuned_model_fine_tunes_from_its_parent_without_a_search(fine_tuned: FineTuned) -> None:
    labelled, parent = fine_tuned.labelled, fine_tuned.parent
    # the champion fine-tuned from the outside model on the labelled prefix, from the command line
    champion = registry.resolve(CHILD, registry.CHAMPION)
    assert champion.version == 1
    assert champion.parent == ParentModel(name=PARENT, version=parent.version, uri=parent.uri, freeze_backbone=True)

    # the monitor's drift event for this model, through the retrain deployment's trigger
    retrain = next(spec for spec in deployment_table() if spec.name == "retrain")
    (on_drift,) = [t for t in retrain.triggers if t.name == "retrain-on-drift"]
    parameters = _render({**retrain.parameters, **(on_drift.parameters or {})}["request"], {"model": CHILD})
    assert parameters["tune_samples"] == 4 and parameters["model_name"] == CHILD
    # the flow's default number of epochs is not what is claimed here; not the command line's one epoch
    # either, which would be the same run as the champion's, its result reused rather than trained again
    assert "epochs" not in parameters
    result = train_model(TrainRequest(**parameters, epochs=2))

    assert result.tuned is None and not lineage.read_records("tune"), "no search for a fine-tune"
    version = result.registration.version
    assert version.flow_run_id is not None
    said = [m for m in _flow_run_logs(version.flow_run_id) if "no hyper-parameter search" in m]
    assert said and "tune_samples=4 ignored" in said[0] and f"{PARENT} v1" in said[0], said
    assert (version.name, version.version) == (CHILD, 2)
    assert version.parent == champion.parent, "from the same parent version, head only as before"
    assert version.image_spec == parent.image_spec and version.classes == ["china", "flower"]
    assert result.registration.decision.champion == 1, "gated against its own champion, not the floor"
    assert "champion v1" in result.registration.decision.reason
    assert result.data.ingest.source_uri == storage.normalize(labelled), "the prefix it was fine-tuned on"
    assert not storage.exists(storage.join(fine_tuned.root, RAW_DIR))


def test_an_outside_champion_is_not_retrained_from_scratch(local_storage: str) -> None:
    register_outside("photos", crop=64)
    with pytest.raises(ConfigError, match="outside model .* init_from=photos@champion"):
        train_model(TrainRequest(model_name="photos", tune_samples=4, promote_to="challenger"))
    assert [v.version for v in registry.list_versions("photos")] == [1]


PARENT_CLASSES = ["cat", "dog", "bird"]  # the photos have two: china, flower
PACKAGE = "ftnet_shipped"  # written to a temporary folder by the test: importable nowhere else
NET = '''
from torch import nn


class Net(nn.Module):
    """A small CNN whose classifier is the last of two Linear layers; it takes no num_classes."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def build(width: int = 4, classes: int = 1000) -> Net:
    return Net(width, classes)
'''


def _sidecar(fine_tuned: FineTuned, folder: Path) -> str:
    """Three classes, and the image spec of the module's first parent: the photos prepared for it are reused."""
    path = folder / "model.json"
    image = fine_tuned.parent.image_spec.model_dump(mode="json")
    path.write_text(json.dumps({"classes": PARENT_CLASSES, "image": image}))
    return str(path)


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _fine_tune(fine_tuned: FineTuned, parent: str, *options: str) -> registry.ModelVersion:
    """``train-model --init-from PARENT@champion`` on the photos, one epoch, one worker; the child's champion."""
    args = ["--source", fine_tuned.labelled, "--epochs", "1", "--num-workers", "1", "--floor", "0", *options]
    output = _cli("train-model", "--init-from", f"{parent}@champion", *args)
    assert f"fine-tuned from    {parent} v1" in output
    return registry.resolve(f"{parent}-ft", registry.CHAMPION)


def _predicts(version: registry.ModelVersion) -> None:
    """The child loads through the one model interface and gives a probability per class."""
    model = load_version(version, optimize=False)
    batch = np.random.default_rng(0).standard_normal((3, 3, 64, 64)).astype(np.float32)
    probabilities = model.probabilities(batch)
    assert probabilities.shape == (3, 2) and np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)


def test_a_factory_shipped_with_code_fine_tunes_from_the_command_line(fine_tuned: FineTuned, tmp_path: Path) -> None:
    code = tmp_path / "code" / PACKAGE
    code.mkdir(parents=True)
    (code / "__init__.py").write_text('__version__ = "0.3.1"\n')
    (code / "models.py").write_text(NET)
    assert importlib.util.find_spec(PACKAGE) is None, "the package must reach Ray only through --code"
    namespace: dict[str, object] = {}
    exec(compile(NET, "net", "exec"), namespace)  # the user's notebook: build it, save its weights
    torch.manual_seed(0)
    weights = tmp_path / "factory.pt"
    torch.save(namespace["build"](width=8, classes=3).state_dict(), weights)  # type: ignore[operator]

    _cli("register-model", "--name", "own-net", "--weights", str(weights), "--factory",
         f"{PACKAGE}.models:build", "--factory-kwargs", '{"width": 8}', "--code", str(code),
         "--sidecar", _sidecar(fine_tuned, tmp_path), "--alias", "champion")  # fmt: skip
    parent = registry.resolve("own-net", registry.CHAMPION)
    factory = parent.model_spec.factory
    assert parent.model_spec.arch == FACTORY and factory is not None
    assert (factory.target, factory.build_kwargs) == (f"{PACKAGE}.models:build", {"width": 8})
    assert factory.package_version == "0.3.1", "the version --code's __init__ declares"
    assert factory.code_uri is not None and storage.exists(factory.code_uri)

    # Train's worker imports the package only from the version's stored zip
    child = _fine_tune(fine_tuned, "own-net", "--freeze-backbone")
    assert child.model_spec.factory == factory and child.model_spec.num_classes == 2
    assert child.parent == ParentModel(name="own-net", version=1, uri=parent.uri, freeze_backbone=True)
    tuned, start = load_state_dict(child.weights_uri), load_state_dict(parent.weights_uri)
    assert tuple(start["classifier.2.weight"].shape) == (3, 8)
    assert tuple(tuned["classifier.2.weight"].shape) == (2, 8), "the last Linear is the new head"
    for key in ("features.0.weight", "features.1.running_mean", "classifier.0.weight"):
        assert torch.equal(tuned[key], start[key]), f"{key} moved although the backbone was frozen"
    _predicts(child)


def test_fine_tuning_an_onnx_parent_is_refused_before_any_cluster_time(fine_tuned: FineTuned, tmp_path: Path) -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)
    ).eval()
    onnx = tmp_path / "model.onnx"
    torch.onnx.export(model, (torch.randn(2, 3, 64, 64),), str(onnx), input_names=["input"], dynamo=False,
                      dynamic_axes={"input": {0: "batch"}})  # fmt: skip
    _cli("register-model", "--name", "from-onnx", "--weights", str(onnx), "--sidecar",
         _sidecar(fine_tuned, tmp_path), "--alias", "champion")  # fmt: skip

    def written() -> set[str]:  # but the command's own log file and its run's lineage events
        keys = {o.key for o in storage.list_objects(fine_tuned.root)}
        return {k for k in keys if "/logs/" not in f"/{k}" and not k.startswith("lineage/openlineage/")}

    def lineage_events() -> list[str]:
        keys = {o.key for o in storage.list_objects(fine_tuned.root)}
        return sorted(k for k in keys if k.startswith("lineage/openlineage/"))

    before, events_before = written(), lineage_events()

    result = CliRunner().invoke(
        app, ["train-model", "--init-from", "from-onnx@champion", "--source", fine_tuned.labelled]
    )
    assert result.exit_code == 3, result.output
    message = " ".join(result.output.split())
    assert "from-onnx v1 is an ONNX file, an inference-only format" in message, message
    assert "--arch" in message and "--factory" in message, "it says what to register instead"
    assert written() == before, "nothing prepared, trained or registered"
    new_events = [k for k in lineage_events() if k not in events_before]
    states = [k.split("-train-model-")[1].split("-")[0] for k in new_events]
    assert states == ["START", "FAIL"], f"a lineage consumer sees the refused run as failed: {new_events}"
    assert registry.alias_version("from-onnx-ft", registry.CHAMPION) is None
