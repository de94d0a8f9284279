"""Each registered version as a real MLflow model, for the registry mirror (``rayline.models.mlflow_mirror``).

An MLflow pyfunc written as code (``mlflow_pyfunc``) with the version's own files as artifacts, so
``mlflow.pyfunc.load_model("models:/<name>@champion")`` predicts what rayline predicts from image bytes,
preprocessing included, for every format. Not ``mlflow.pytorch``, nor a cloudpickled ``PythonModel``: both
pickle, and rayline keeps pickles out of its registry. Not ``mlflow.onnx``: ONNX only, and it takes
normalised tensors. This layer, not the core mirror, says how a version becomes an MLflow model because
that needs rayline's model interface, which the core may not import. Tasks call :func:`reconcile` here.
"""

from __future__ import annotations

import importlib.metadata
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from rayline import storage
from rayline.models import mlflow_mirror, registry
from rayline.models.mlflow_mirror import MirrorReport
from rayline.specs import ONNX, ModelSpec
from rayline.storage import layout

if TYPE_CHECKING:
    from mlflow.models import ModelSignature

PYFUNC_CODE = Path(__file__).with_name("mlflow_pyfunc.py")
# what the pyfunc imports itself; rayline's other dependencies come with rayline
_ALWAYS = ("mlflow", "torch", "torchvision", "numpy", "pandas", "pillow", "pydantic")


def reconcile(name: str) -> MirrorReport | None:
    """``mlflow_mirror.reconcile`` with each new version logged as rayline's pyfunc; never raises."""
    return mlflow_mirror.reconcile(name, save_version)


def pip_requirements(spec: ModelSpec) -> list[str]:
    """The loading environment, pinned to what logged it: rayline, and the packages the pyfunc and
    ``spec``'s format import (given, since MLflow's inference loads the model in a subprocess)."""
    wanted = [*_ALWAYS]
    if spec.format == ONNX:
        wanted.append("onnxruntime")
    if spec.timm_name is not None:
        wanted.append("timm")
    if spec.factory is not None and spec.factory.package is not None:
        wanted.append(spec.factory.package)
    wanted.append("rayline")
    pins = []
    for dist in wanted:
        try:
            pins.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(dist)
    return pins


def save_version(version: registry.ModelVersion, model_file: bytes, path: Path) -> None:
    """Write ``version`` (its model file's bytes given) as an MLflow pyfunc model at ``path``."""
    import mlflow.pyfunc

    from rayline.ray_workloads.registration import mlflow_pyfunc as code

    with tempfile.TemporaryDirectory(prefix="rayline-mlflow-") as tmp:
        staged = Path(tmp)
        artifacts = {
            code.VERSION_ARTIFACT: _write(staged / layout.VERSION_FILE, version.model_dump_json(indent=2).encode()),
            code.MODEL_ARTIFACT: _write(staged / _name(version.weights_uri), model_file),
        }
        factory = version.model_spec.factory
        if factory is not None and factory.code_uri is not None:
            zipped = storage.read_bytes(factory.code_uri)
            artifacts[code.CODE_ARTIFACT] = _write(staged / _name(factory.code_uri), zipped)
        with warnings.catch_warnings():
            # no input example on purpose: MLflow would load and run the model to check it, at every mirror
            warnings.filterwarnings("ignore", ".*An input example was not provided", UserWarning)
            mlflow.pyfunc.save_model(
                path=str(path),
                python_model=str(PYFUNC_CODE),
                artifacts=artifacts,
                signature=signature(),
                pip_requirements=pip_requirements(version.model_spec),
                metadata={"rayline.name": version.name, "rayline.version": version.version, "rayline.uri": version.uri},
            )


def _name(uri: str) -> str:
    return uri.rstrip("/").rpartition("/")[2]


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def signature() -> ModelSignature:
    """Image bytes in; class index, name, confidence, the top-k and a decode error out; ``top_k`` a parameter."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import Array

    from rayline.ray_workloads.registration import mlflow_pyfunc as code

    return ModelSignature(
        inputs=Schema([ColSpec(DataType.binary, code.IMAGE_COLUMN)]),
        outputs=Schema(
            [
                ColSpec(DataType.long, "class_index"),
                ColSpec(DataType.string, "class_name", required=False),
                ColSpec(DataType.double, "confidence"),
                ColSpec(Array(DataType.string), "top_classes"),
                ColSpec(Array(DataType.double), "top_confidences"),
                ColSpec(DataType.string, "error", required=False),
            ]
        ),
        params=ParamSchema([ParamSpec("top_k", DataType.long, code.TOP_K)]),
    )
