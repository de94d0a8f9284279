"""The MLflow model's own preprocessing and its ONNX file, against rayline's (no MLflow server: test_mlflow's).

The pyfunc restates rayline's ``decode_image`` with Pillow alone, so that it loads without rayline: the two
must give the same array, bit for bit, on every path (both sizing modes, reduced-scale JPEG decoding in
every EXIF orientation, transparency, palettes, 16-bit grayscale, CMYK) and fail with the same names. Every
torch format becomes an ONNX file answering what rayline's model answers; one that cannot is refused.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from rayline.errors import ImageDecodeError, ModelExportError
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.architectures.build import SmallCNN, imagenet_image_spec, state_dict_bytes
from rayline.ray_workloads.data.images import decode_image
from rayline.ray_workloads.execution.interface import load_version
from rayline.ray_workloads.registration import mlflow_pyfunc
from rayline.ray_workloads.registration.onnx_export import version_onnx
from rayline.seed import EXIF_ORIENTATION, camera_photo, jpeg_bytes, source_photos
from rayline.specs import FACTORY, FactoryRef, ImageSpec, ModelSpec, squash

pytestmark = pytest.mark.unit

# what the pyfunc may import: MLflow's model API, the image and array libraries, ONNX Runtime
PYFUNC_IMPORTS = {"base64", "binascii", "io", "json", "warnings", "collections", "pathlib", "typing"}
PYFUNC_IMPORTS |= {"numpy", "pandas", "mlflow", "PIL", "onnxruntime"}


def _encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _oriented(orientation: int) -> bytes:
    """An odd-sided JPEG over twice a 232 px side, stored with ``orientation``: a reduced decode with an overhang."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    return jpeg_bytes(source_photos()[1].resize((1031, 1543), Image.Resampling.BICUBIC), 90, exif)


@functools.cache
def _images() -> dict[str, bytes]:
    china, flower = source_photos()
    rng = np.random.default_rng(0)
    sixteen = Image.fromarray((rng.integers(0, 65535, (40, 60))).astype(np.uint16))
    palette = flower.crop((0, 0, 120, 90)).convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 0
    return {
        "photo": jpeg_bytes(china, 92),
        "tall": jpeg_bytes(china.crop((200, 0, 330, 427)), 85),
        "small": jpeg_bytes(flower.crop((300, 200, 400, 290)), 75),
        "camera-3mp": camera_photo(3, np.random.default_rng(3)),
        "rgba-png": _encode(Image.fromarray(rng.integers(0, 255, (50, 70, 4), dtype=np.uint8), "RGBA"), "PNG"),
        "transparent-palette": _encode(palette, "PNG"),
        "16-bit": _encode(sixteen, "PNG"),
        "grayscale": jpeg_bytes(china.convert("L"), 90),
        "cmyk": _encode(china.crop((100, 50, 400, 300)).convert("CMYK"), "JPEG", quality=90),
        **{f"exif-{o}": _oriented(o) for o in range(1, 9)},
    }


def _specs() -> dict[str, ImageSpec]:
    imagenet = imagenet_image_spec("resnet18")
    return {
        "imagenet": imagenet,
        "imagenet-full-decode": imagenet.model_copy(update={"draft": False}),
        "resize-crop-64-bicubic": imagenet.model_copy(update={"resize": 73, "crop": 64, "interpolation": "bicubic"}),
        "squash-32": squash(32),
        "squash-96-nearest": ImageSpec(crop=96, interpolation="nearest", mean=(0.1, 0.2, 0.3), std=(0.9, 0.8, 0.7)),
    }


def _as_logged(spec: ImageSpec) -> dict[str, object]:
    """The image spec as the pyfunc reads it: from the version's JSON."""
    return json.loads(spec.model_dump_json())  # type: ignore[no-any-return]


def test_the_pyfunc_imports_nothing_of_rayline_or_torch() -> None:
    tree = ast.parse(Path(mlflow_pyfunc.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= PYFUNC_IMPORTS, imported


@pytest.mark.parametrize("spec_name", sorted(_specs()))
def test_the_pyfunc_decodes_every_image_as_rayline_does(spec_name: str) -> None:
    spec = _specs()[spec_name]
    for name, data in _images().items():
        decoded = mlflow_pyfunc.decode(data, _as_logged(spec))
        assert isinstance(decoded, np.ndarray) and np.array_equal(decoded, decode_image(data, spec)), name


def test_the_pyfunc_names_an_undecodable_image_as_rayline_does() -> None:
    photo = jpeg_bytes(source_photos()[0], 90)
    spec = squash(32)
    cases = {
        "empty": b"",
        "not an image": b"not an image",
        "truncated": photo[: len(photo) // 3],
        "too many pixels": photo,
    }
    for name, data in cases.items():
        limited = spec.model_copy(update={"max_pixels": 1000}) if name == "too many pixels" else spec
        with pytest.raises(ImageDecodeError) as rayline_error:
            decode_image(data, limited)
        said = mlflow_pyfunc.decode(data, _as_logged(limited))
        assert said == f"{type(rayline_error.value).__name__}: {rayline_error.value}", name


class _Tiny(nn.Module):
    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2), nn.BatchNorm2d(6), nn.ReLU())
        self.head = nn.Linear(6, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))  # type: ignore[no-any-return]


class _Branching(_Tiny):
    """Data-dependent control flow: a trace follows the branch its example took."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if bool(x.sum() <= 0) else -out


class _Unexportable(_Tiny):
    """An operator ONNX has no counterpart for (at the opset rayline exports to)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(super().forward(x), dim=1).values


def branching(num_classes: int) -> nn.Module:
    return _Branching(num_classes)


def unexportable(num_classes: int) -> nn.Module:
    return _Unexportable(num_classes)


def _version(tmp_path: Path, spec: ModelSpec, data: bytes, size: int = 32) -> tuple[ModelVersion, bytes]:
    path = tmp_path / f"model-{spec.format}-{len(list(tmp_path.iterdir()))}"
    path.write_bytes(data)
    version = ModelVersion(
        name="pets",
        version=1,
        uri=str(tmp_path / "v1"),
        weights_uri=str(path),
        model_spec=spec,
        image_spec=squash(size),
        classes=[f"class-{i}" for i in range(spec.num_classes)],
        metrics={},
        code_version="test",
    )
    return version, data


def _torchscript(tmp_path: Path) -> tuple[ModelVersion, bytes]:
    torch.manual_seed(1)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates TorchScript; users still have such files
        torch.jit.save(torch.jit.script(_Tiny().eval()), buffer)  # type: ignore[no-untyped-call]
    return _version(tmp_path, ModelSpec(arch="torchscript", num_classes=4), buffer.getvalue())


def _program(tmp_path: Path, dynamic: bool) -> tuple[ModelVersion, bytes]:
    torch.manual_seed(2)
    shapes = {"dynamic_shapes": ({0: torch.export.Dim("batch", min=1, max=64)},)} if dynamic else {}
    program = torch.export.export(_Tiny().eval(), (torch.randn(2, 3, 32, 32),), **shapes)  # type: ignore[arg-type]
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return _version(tmp_path, ModelSpec(arch="torch_export", num_classes=4), buffer.getvalue())


def _state_dict(tmp_path: Path) -> tuple[ModelVersion, bytes]:
    torch.manual_seed(3)
    return _version(tmp_path, ModelSpec(num_classes=5, width=8), state_dict_bytes(SmallCNN(5, 8)))


def _factory(tmp_path: Path, build: str) -> tuple[ModelVersion, bytes]:
    torch.manual_seed(4)
    ref = FactoryRef(target=f"{__name__}:{build}")
    return _version(tmp_path, ModelSpec(arch=FACTORY, num_classes=4, factory=ref), state_dict_bytes(_Tiny(4)))


@pytest.mark.parametrize("fmt", ["state_dict", "torchscript", "torch_export-fixed-batch", "torch_export-dynamic"])
def test_each_torch_format_exports_to_onnx_answering_as_rayline(tmp_path: Path, fmt: str) -> None:
    made = {
        "state_dict": lambda: _state_dict(tmp_path),
        "torchscript": lambda: _torchscript(tmp_path),
        "torch_export-fixed-batch": lambda: _program(tmp_path, dynamic=False),
        "torch_export-dynamic": lambda: _program(tmp_path, dynamic=True),
    }
    version, data = made[fmt]()
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(version_onnx(version, data))
    exported = mlflow_pyfunc.OnnxClassifier(str(onnx))
    assert exported.fixed_batch == (2 if fmt == "torch_export-fixed-batch" else None)
    photos = [jpeg_bytes(p, 90) for p in source_photos()] + [jpeg_bytes(source_photos()[0].rotate(90), 80)]
    batch = np.stack([decode_image(p, version.image_spec) for p in photos])  # 3: a fixed batch of 2 is padded
    # rayline's own file model calls a fixed-batch file only with whole batches of its size: 4 rows, the last blank
    padded = np.concatenate([batch, np.zeros_like(batch[:1])])
    expected = load_version(version).probabilities(padded)[: len(batch)]
    assert np.abs(exported.probabilities(batch) - expected).max() < 1e-5
    assert len({tuple(np.round(row, 4)) for row in expected}) == len(photos), "the scores depend on the image"


def test_an_onnx_version_is_its_own_file(tmp_path: Path) -> None:
    version, data = _version(tmp_path, ModelSpec(arch="onnx", num_classes=4), b"\x08\x07 any ONNX bytes")
    assert version_onnx(version, data) == data


def test_a_module_onnx_cannot_express_or_answering_otherwise_is_refused(tmp_path: Path) -> None:
    version, data = _factory(tmp_path, "unexportable")
    with pytest.raises(ModelExportError, match="does not export to ONNX.*cummax"):
        version_onnx(version, data)
    version, data = _factory(tmp_path, "branching")
    with pytest.raises(ModelExportError, match="answers otherwise than the model"):
        version_onnx(version, data)
