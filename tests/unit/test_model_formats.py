"""Registering code-free files and state dicts: what is refused, and how the refusal reads.

Each refusal names the format, what was expected and what was found. One
tiny classifier (3 classes, 32 px) is saved once in every format; a ``.pt2``
carrying a pickled object is crafted from a real one. A factory's build and
probe run in a Ray task, so what needs the cluster is tested in
tests/integration/test_fine_tune.py and test_any_model.py; here only what is refused before it.
"""

from __future__ import annotations

import io
import json
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rayline.cli import app
from rayline.errors import ConfigError, InputDataError, UnsafeModelFileError
from rayline.ray_workloads.architectures import factory_models
from rayline.ray_workloads.execution.interface import load_version
from rayline.ray_workloads.registration.outside_models import RegisterModelConfig, RegisterModelResult, run

pytestmark = pytest.mark.unit

SIDE = 32
PAYLOAD_RAN: list[str] = []  # what a crafted payload's unpickling would append to


def _mark(what: str) -> int:
    PAYLOAD_RAN.append(what)
    return 1


class Payload:
    """Unpickling it calls :func:`_mark`: arbitrary code, as a malicious file would run."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_mark, ("unpickled",))


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)
    ).eval()


def _jit_save(module: torch.nn.Module, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates TorchScript; users still have such files
        torch.jit.save(torch.jit.script(module), str(path))  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny classifier in every format: dynamic batch, and ONNX/.pt2 exported for a batch of 1."""
    folder = tmp_path_factory.mktemp("formats")
    model = _tiny()
    paths = {name: folder / name for name in ("model.pt", "model.pt2", "b1.pt2", "model.onnx", "b1.onnx")}
    _jit_save(model, paths["model.pt"])
    batch = torch.export.Dim("batch", min=1, max=1024)
    example = (torch.randn(2, 3, SIDE, SIDE),)
    torch.export.save(torch.export.export(model, example, dynamic_shapes=({0: batch},)), str(paths["model.pt2"]))
    torch.export.save(torch.export.export(model, (torch.randn(1, 3, SIDE, SIDE),)), str(paths["b1.pt2"]))
    dynamic = {"input": {0: "batch"}}
    torch.onnx.export(
        model, example, str(paths["model.onnx"]), input_names=["input"], dynamo=False, dynamic_axes=dynamic
    )
    torch.onnx.export(model, (example[0][:1],), str(paths["b1.onnx"]), input_names=["input"], dynamo=False)
    paths["classes"] = folder / "classes.txt"
    paths["classes"].write_text("cat\ndog\nbird\n")
    paths["state"] = folder / "state.pt"
    torch.save(model.state_dict(), paths["state"])
    return paths


def _register(files: dict[str, Path], name: str, weights: str | Path, **options: object) -> RegisterModelResult:
    cfg = {"classes": str(files["classes"]), "crop": SIDE, **options}
    return run(RegisterModelConfig(name=name, weights_uri=str(weights), **cfg))  # type: ignore[arg-type]


def _crafted_pt2(source: Path, path: Path, *, constant: bool) -> Path:
    """``source`` rewritten as torch.export writes a pickled payload: a ``use_pickle`` weight, or a custom object."""
    with zipfile.ZipFile(source) as archive:
        entries = {info.filename: archive.read(info.filename) for info in archive.infolist()}
    if constant:
        (config,) = [n for n in entries if n.endswith("model_constants_config.json")]
        entries[config] = json.dumps({"config": {"tokenizer": {"path_name": "custom_obj_0"}}}).encode()
    else:
        (config,) = [n for n in entries if n.endswith("model_weights_config.json")]
        weights = json.loads(entries[config])
        entry = weights["config"]["3.bias"]  # the head's bias, "pickled" as torch.export's fallback writes one
        entry["use_pickle"] = True
        entries[config] = json.dumps(weights).encode()
        pickled = io.BytesIO()
        torch.save(Payload(), pickled)
        entries[f"{config.rsplit('/', 1)[0]}/{entry['path_name']}"] = pickled.getvalue()
    with zipfile.ZipFile(path, "w") as out:
        for name, data in entries.items():
            out.writestr(name, data)
    return path


@pytest.mark.parametrize("constant", [False, True], ids=["pickled-weight", "custom-object"])
def test_a_pt2_that_would_unpickle_an_object_is_refused_unread(
    files: dict[str, Path], local_storage: str, tmp_path: Path, constant: bool
) -> None:
    crafted = _crafted_pt2(files["model.pt2"], tmp_path / "crafted.pt2", constant=constant)
    expected = "constant tokenizer is a pickled Python object" if constant else "its payload .*/weight_3 holds pickled"
    with pytest.raises(UnsafeModelFileError, match=f"refusing .*crafted.pt2: {expected}") as refused:
        _register(files, "crafted", crafted)
    assert not PAYLOAD_RAN, "the payload was unpickled"
    assert "weights_only" not in str(refused.value) and "\x1b" not in str(refused.value), "no advice to bypass"
    if not constant:
        assert "GLOBAL tests.unit.test_model_formats._mark" in str(refused.value), "the global it would call"


@pytest.mark.parametrize(("file", "what"), [("model.pt", "TorchScript"), ("model.pt2", ".pt2"), ("model.onnx", "ONNX")])
def test_outputs_that_are_not_one_per_class_are_refused_with_both_shapes(
    files: dict[str, Path], local_storage: str, tmp_path: Path, file: str, what: str
) -> None:
    five = tmp_path / "five.txt"
    five.write_text("a\nb\nc\nd\ne\n")
    with pytest.raises(InputDataError) as refused:
        _register(files, "wrong-count", files[file], classes=str(five))
    message = str(refused.value)
    assert what in message and f"input (2, 3, {SIDE}, {SIDE})" in message
    assert "returned scores of shape (2, 3); expected (2, 5)" in message and "(5 classes)" in message


def test_a_crop_the_onnx_file_does_not_take_names_its_declared_input(
    files: dict[str, Path], local_storage: str
) -> None:
    with pytest.raises(InputDataError) as refused:
        _register(files, "wrong-crop", files["model.onnx"], crop=48)
    message = str(refused.value)
    assert "model.onnx (ONNX): a probe forward pass on input (2, 3, 48, 48) failed" in message
    assert f"the file declares input ['batch', 3, {SIDE}, {SIDE}]" in message and "--crop" in message


def test_an_onnx_file_whose_weights_are_in_a_second_file_is_refused_with_how_to_export_one(
    files: dict[str, Path], local_storage: str, tmp_path: Path
) -> None:
    """torch.onnx.export's default since torch 2.9: the weights in NAME.onnx.data, beside the graph."""
    import onnx

    split = tmp_path / "split.onnx"
    onnx.save_model(onnx.load(str(files["model.onnx"])), str(split), save_as_external_data=True, size_threshold=0)
    with pytest.raises(InputDataError, match=r"separate file .* torch\.onnx\.export\(\.\.\., external_data=False\)"):
        _register(files, "split", split)


@pytest.mark.parametrize("file", ["b1.onnx", "b1.pt2"])
def test_a_file_exported_for_one_image_runs_any_batch_in_slices(
    files: dict[str, Path], local_storage: str, file: str
) -> None:
    version = _register(files, "batch-one", files[file]).version
    batch = np.random.default_rng(1).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
    scores = load_version(version).logits(batch)
    with torch.no_grad():
        expected = _tiny()(torch.from_numpy(batch)).numpy()
    assert scores.shape == (3, 3) and np.allclose(scores, expected, atol=1e-5)


def test_a_whole_model_file_with_arch_is_refused_and_a_state_dict_needs_one(
    files: dict[str, Path], local_storage: str
) -> None:
    with pytest.raises(
        ConfigError, match="model.pt is a TorchScript file, but --arch/--factory says a state dict: drop --arch"
    ):
        _register(files, "ts", files["model.pt"], arch="resnet18")
    with pytest.raises(ConfigError, match="model.onnx is an ONNX file, the whole model: --arch resnet18 names"):
        _register(files, "ts", files["model.onnx"], arch="resnet18", format="onnx")
    with pytest.raises(
        ConfigError,
        match="model.pt is a TorchScript file, but --format onnx says an ONNX file: give --format torchscript",
    ):
        _register(files, "ts", files["model.pt"], format="onnx")
    with pytest.raises(ConfigError, match=r"state.pt is a state dict: say what it is the weights of with --arch"):
        _register(files, "sd", files["state"])


def test_a_sidecar_that_is_not_the_expected_json_is_refused_with_its_shape(
    files: dict[str, Path], local_storage: str, tmp_path: Path
) -> None:
    shape = '{"classes": ["cat", "dog"], "image": {"mode": "resize_crop"'
    for text, found in [("{classes: [", "Expecting property name"), ('{"image": {"crop": "big"}}', "image.crop")]:
        sidecar = tmp_path / "model.json"
        sidecar.write_text(text)
        with pytest.raises(InputDataError) as refused:
            _register(files, "sidecar", files["model.onnx"], sidecar=str(sidecar))
        message = str(refused.value)
        assert f"sidecar {sidecar}" in message and found in message and f"expected JSON like {shape}" in message


def test_a_timm_name_typo_suggests_close_names(files: dict[str, Path], local_storage: str) -> None:
    pytest.importorskip("timm")
    with pytest.raises(
        ConfigError, match=r"--arch timm:resnet_18: timm .* has no model 'resnet_18'; did you mean resnet18"
    ):
        _register(files, "typo", "never-read.pt", arch="timm:resnet_18")


@pytest.mark.parametrize("target", ["mynet.models", "mynet.models:", ":build", "my-net.models:build", "mynet:1st"])
def test_a_malformed_factory_is_refused_before_the_file_is_read(
    files: dict[str, Path], local_storage: str, target: str
) -> None:
    with pytest.raises(ConfigError, match=r"--factory .*: expected 'package.module:callable', e.g. mynet.models:build"):
        _register(files, "factory", "never-read.pt", factory=target)


def test_code_whose_folder_is_not_the_factorys_package_is_refused(
    files: dict[str, Path], local_storage: str, tmp_path: Path
) -> None:
    code = tmp_path / "othernet"
    code.mkdir()
    (code / "__init__.py").write_text("")
    with pytest.raises(ConfigError, match="the folder is package 'othernet', but the factory imports 'mynet'"):
        _register(files, "factory", files["state"], factory="mynet.models:build", code=str(code))
    with pytest.raises(ConfigError, match="--code .* expected a package folder"):
        _register(files, "factory", files["state"], factory="mynet.models:build", code=str(tmp_path))
    with pytest.raises(ConfigError, match="--code and --factory-kwargs go with --factory"):
        _register(files, "factory", files["state"], arch="resnet18", code=str(code))


def test_the_package_version_is_read_from_the_code_without_importing_it(tmp_path: Path) -> None:
    for line, version in [('__version__ = "0.3.1"', "0.3.1"), ("__version__: str = '2.0'", "2.0"), ("x = 1", None)]:
        (tmp_path / "__init__.py").write_text(f"raise SystemExit('imported')\n{line}\n")
        assert factory_models.declared_version(str(tmp_path)) == version


@pytest.mark.parametrize("kwargs", ["[1, 2]", '"width"', "{width: 64}"])
def test_factory_kwargs_on_the_command_line_must_be_a_json_object(local_storage: str, kwargs: str) -> None:
    args = ["register-model", "--name", "own", "--weights", "never-read.pt", "--factory", "mynet.models:build"]
    result = CliRunner().invoke(app, [*args, "--factory-kwargs", kwargs])
    assert result.exit_code == 3, result.output
    assert "--factory-kwargs must be a JSON object" in " ".join(result.output.split()), result.output


@pytest.mark.parametrize("file", ["model.pt", "model.pt2", "model.onnx", "timm"])
def test_the_same_bytes_registered_again_are_the_same_version(
    files: dict[str, Path], local_storage: str, tmp_path: Path, file: str
) -> None:
    options: dict[str, object] = {}
    path = files.get(file)
    if file == "timm":
        timm = pytest.importorskip("timm")
        path = tmp_path / "timm.pt"
        torch.save(timm.create_model("test_efficientnet", pretrained=False, num_classes=3).state_dict(), path)
        options = {"arch": "timm:test_efficientnet", "crop": None}
    first = _register(files, "again", path, **options)
    second = _register(files, "again", path, **options)
    assert not first.reused and second.reused
    assert second.version.version == first.version.version == 1
    assert second.version.model_spec.format == first.version.model_spec.format
