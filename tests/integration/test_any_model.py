"""Real architectures as users bring them: registered from the command line, a small night each, one photo served.

Every model is built with ``weights=None`` (nothing can be downloaded) and
saved the way its owner would: a torchvision or timm state dict, a TorchScript
trace, a ``torch.export`` program, an ONNX export, and a state dict of the
user's own class whose package the test writes to a temporary folder and
ships with ``--code`` (so Ray's workers and replicas import it only from the
version's stored zip). Small inputs (64 px where the family allows it; the ViT's
224 px is fixed) and six photos a night: these check that each format runs
end to end, not accuracy. One module fixture registers them all; the nights
share the day's photos and the serving test one Serve instance.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torchvision
from typer.testing import CliRunner

from rayline import storage
from rayline.cli import app
from rayline.flows.serve_rollout import serve_config
from rayline.models import registry
from rayline.ray_workloads.architectures.build import imagenet_classes
from rayline.ray_workloads.serving import control as serve_control
from rayline.seed import jpeg_bytes, photo_objects, source_photos
from rayline.tables.prediction_reads import read_night_pair
from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

DAY = "2026-11-28"
PHOTOS = 6
SIDE = 64
PACKAGE = "anynet_shipped"  # written to a temporary folder by the test: importable nowhere else
OWN_CLASSES = ["cat", "dog", "bird"]
NET = '''
from torch import nn


class OwnNet(nn.Module):
    """A user's own classifier: a class of their notebook, not a torchvision name."""

    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def build(width: int = 8, num_classes: int = 3) -> nn.Module:
    return OwnNet(width, num_classes)
'''


@dataclass(frozen=True)
class Case:
    """One user's model: how the test saves it, and the register-model options that go with the file."""

    name: str
    save: Callable[[Path], list[str]]  # writes the file(s) into a folder; returns the CLI options
    classes: list[str]


def _vit(folder: Path) -> list[str]:
    path = folder / "vit_b_16.pt"
    torch.save(torchvision.models.vit_b_16(weights=None).state_dict(), path)
    return ["--weights", str(path), "--arch", "vit_b_16"]  # its own 224 px: a ViT's input size is fixed


def _timm(folder: Path) -> list[str]:
    import timm

    path = folder / "timm.pt"
    torch.save(timm.create_model("mobilenetv3_small_050", pretrained=False).state_dict(), path)
    return ["--weights", str(path), "--arch", "timm:mobilenetv3_small_050", "--crop", str(SIDE)]


def _example() -> torch.Tensor:
    return torch.randn(2, 3, SIDE, SIDE)


def _torchscript(folder: Path) -> list[str]:
    path = folder / "resnet.ts"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates TorchScript; users still have such files
        traced = torch.jit.trace(torchvision.models.resnet18(weights=None).eval(), _example())  # type: ignore[no-untyped-call]
        torch.jit.save(traced, str(path))  # type: ignore[no-untyped-call]
    return ["--weights", str(path), "--crop", str(SIDE)]


def _torch_export(folder: Path) -> list[str]:
    path = folder / "mobilenet.pt2"
    model = torchvision.models.mobilenet_v3_small(weights=None).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.export.save(torch.export.export(model, (_example(),), dynamic_shapes=({0: batch},)), str(path))
    return ["--weights", str(path), "--crop", str(SIDE)]


def _onnx(folder: Path) -> list[str]:
    path = folder / "resnet18.onnx"
    model = torchvision.models.resnet18(weights=None).eval()
    torch.onnx.export(
        model, (_example(),), str(path), input_names=["image"], dynamo=False, dynamic_axes={"image": {0: "batch"}}
    )
    return ["--weights", str(path), "--crop", str(SIDE)]


def _factory(folder: Path) -> list[str]:
    code = folder / "code" / PACKAGE
    code.mkdir(parents=True)
    (code / "__init__.py").write_text('__version__ = "1.2.0"\n')
    (code / "models.py").write_text(NET)
    namespace: dict[str, object] = {}
    exec(compile(NET, "net", "exec"), namespace)  # the user's notebook: build it, save its weights
    build = namespace["build"]
    assert callable(build)
    path = folder / "own.pt"
    torch.save(build(width=8, num_classes=len(OWN_CLASSES)).state_dict(), path)
    classes = folder / "classes.txt"
    classes.write_text("\n".join(OWN_CLASSES) + "\n")
    return [
        "--weights", str(path), "--factory", f"{PACKAGE}.models:build", "--factory-kwargs", '{"width": 8}',
        "--code", str(code), "--classes", str(classes), "--crop", str(SIDE),
    ]  # fmt: skip


CASES = [
    Case("vit", _vit, imagenet_classes("vit_b_16")),
    Case("timm-mobilenet", _timm, imagenet_classes("resnet18")),
    Case("torchscript-resnet", _torchscript, imagenet_classes("resnet18")),
    Case("export-mobilenet", _torch_export, imagenet_classes("resnet18")),
    Case("onnx-resnet", _onnx, imagenet_classes("resnet18")),
    Case("own-net", _factory, OWN_CLASSES),
]


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output + (str(result.exception) if result.exception else "")


@dataclass(frozen=True)
class Registered:
    root: str
    incoming: str
    inputs: set[str]
    versions: dict[str, registry.ModelVersion]


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registered]:
    """Every case saved by the test and registered from the command line as its name's champion."""
    folder = tmp_path_factory.mktemp("any-model")
    root = str(folder / "storage")
    assert importlib.util.find_spec(PACKAGE) is None, "the package must reach Ray only through --code"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", root)
        incoming = storage.join(root, "incoming", "photos", f"dt={DAY}")
        for key, data in photo_objects(PHOTOS, np.random.default_rng(3), large_share=0.0):
            storage.write_bytes_atomic(storage.join(incoming, key), data)
        versions = {}
        for case in CASES:
            torch.manual_seed(0)
            started = time.monotonic()
            options = case.save(folder)
            code, out = _cli("register-model", "--name", case.name, *options, "--alias", "champion")
            assert code == 0, f"{case.name}: {out}"
            versions[case.name] = registry.resolve(case.name, registry.CHAMPION)
            print(f"{case.name}: saved and registered in {time.monotonic() - started:.1f} s")
        yield Registered(root, incoming, {o.uri for o in storage.list_objects(incoming)}, versions)


def test_each_format_is_registered_with_what_it_is(registered: Registered) -> None:
    specs = {name: version.model_spec for name, version in registered.versions.items()}
    assert {name: spec.format for name, spec in specs.items()} == {
        "vit": "state_dict",
        "timm-mobilenet": "state_dict", "torchscript-resnet": "torchscript",
        "export-mobilenet": "torch_export", "onnx-resnet": "onnx", "own-net": "state_dict",
    }  # fmt: skip
    assert specs["timm-mobilenet"].arch == "timm:mobilenetv3_small_050"
    assert [name for name, spec in specs.items() if spec.inference_only] == [
        "torchscript-resnet", "export-mobilenet", "onnx-resnet"
    ]  # fmt: skip
    vit = registered.versions["vit"].image_spec
    assert (vit.resize, vit.crop) == (256, 224), "ViT-B/16's own evaluation transform"
    factory = specs["own-net"].factory
    assert factory is not None and factory.package_version == "1.2.0"
    assert factory.code_uri is not None and storage.exists(factory.code_uri)
    for name, version in registered.versions.items():
        assert version.classes == next(c.classes for c in CASES if c.name == name)


def test_a_vit_refuses_a_crop_it_cannot_take_and_says_which_size_it_needs(
    registered: Registered, tmp_path: Path
) -> None:
    weights = registered.versions["vit"].weights_source
    assert weights is not None
    code, out = _cli("register-model", "--name", "vit-small", "--weights", weights.uri, "--arch", "vit_b_16",
                     "--crop", str(SIDE))  # fmt: skip
    message = " ".join(out.split())
    assert code != 0 and "224" in message and str(SIDE) in message, message
    assert registry.list_versions("vit-small") == [], "nothing registered"


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_a_small_night_predicts_every_photo(registered: Registered, case: str) -> None:
    version = registered.versions[case]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", registered.root)
        code, out = _cli("nightly-inference", "--model", f"{case}@champion", "--date", DAY,
                         "--source", registered.incoming, "--actors", "1")  # fmt: skip
        assert code == 0, out
        night = read_night_pair(registered.root, case, DAY)
    assert night.errors.num_rows == 0, night.errors.to_pylist()
    assert sorted(night.predictions.column("uri").to_pylist()) == sorted(registered.inputs)
    for row in night.predictions.to_pylist():
        assert row["model_name"] == case and row["model_version"] == version.version
        assert row["predicted_class"] in version.classes and 0.0 < row["confidence"] <= 1.0
        assert row["top_k_class"] == [version.classes[i] for i in row["top_k_index"]]


# A replica loads its model with the nights' own loader, which the night above runs on every format; served
# again here are only the models whose replica needs what no other does: the user's shipped code, a runtime
# other than torch, a program file. A torchvision state dict serves in test_serve_models.
SERVED = ["own-net", "onnx-resnet", "export-mobilenet"]


@pytest.fixture(scope="module")
def served(registered: Registered) -> Iterator[str]:
    """The :data:`SERVED` models on their own routes of one Serve instance, each at 100 % of its traffic."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", registered.root)
        env.setenv("RAYLINE_SERVE_PORT", str(free_port()))
        env.setenv("RAYLINE_SERVE_CPUS_PER_REPLICA", "0.1")  # three models beside the session's other work
        env.setenv("RAYLINE_SERVE_GRACEFUL_SHUTDOWN_WAIT_LOOP_S", "0.1")
        cfg = serve_config()
        try:
            started = time.monotonic()
            url = serve_control.start(cfg)
            versions = [registered.versions[name] for name in SERVED]
            serve_control.deploy_versions(versions, cfg)  # replicas start in parallel
            for version in versions:
                serve_control.set_weights({version.version: 100.0}, cfg, model=version.name)
            print(f"{len(versions)} models served in {time.monotonic() - started:.1f} s")
            yield url
        finally:
            serve_control.shutdown(cfg)


def test_shipped_code_an_onnx_file_and_an_exported_program_each_serve_a_photo(
    registered: Registered, served: str
) -> None:
    photo = jpeg_bytes(source_photos()[0])
    with httpx.Client(base_url=served, timeout=120, trust_env=False) as client:
        for name in SERVED:
            version = registered.versions[name]
            answer = client.post(f"/models/{name}/predict", content=photo)
            assert answer.status_code == 200, f"{name}: {answer.text}"
            body = answer.json()
            assert body["model"] == name and body["version"] == version.version, body
            assert body["class_name"] in version.classes and len(body["top_k"]) == 3, body
