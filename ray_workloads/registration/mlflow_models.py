"""Each registered version as a real MLflow model, for the registry mirror (``rayline.models.mlflow_mirror``).

An MLflow pyfunc written as code (``mlflow_pyfunc``) over the version as one ONNX file (``onnx_export``: an
ONNX version's own file, any other format's module exported and checked against rayline's answers), so that
``mlflow.pyfunc.load_model("models:/<name>@champion")`` predicts what rayline predicts from image bytes,
preprocessing included, where only MLflow, ONNX Runtime, numpy, pandas and Pillow are installed: no rayline,
no torch, no user code (a factory's module is exported where its code is). Not ``mlflow.pytorch``, nor a
cloudpickled ``PythonModel``: both pickle, and rayline keeps pickles out of its registry. Not ``mlflow.onnx``:
it takes normalised tensors, not images. This layer, not the core mirror, says how a version becomes an MLflow
model because that needs rayline's model interface, which the core may not import. Tasks call
:func:`reconcile` here.
"""

from __future__ import annotations

import importlib.metadata
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from rayline.models import mlflow_mirror, registry
from rayline.models.mlflow_mirror import MirrorReport
from rayline.storage import layout

if TYPE_CHECKING:
    from mlflow.models import ModelSignature

PYFUNC_CODE = Path(__file__).with_name("mlflow_pyfunc.py")
ONNX_FILE = "model.onnx"
# what the pyfunc imports (mlflow-skinny brings the scoring server `mlflow models serve` runs: FastAPI, uvicorn)
REQUIREMENTS = ("mlflow-skinny", "onnxruntime", "numpy", "pandas", "pillow")


def reconcile(name: str) -> MirrorReport | None:
    """``mlflow_mirror.reconcile`` with each new version logged as rayline's pyfunc; never raises."""
    return mlflow_mirror.reconcile(name, save_version)


def pip_requirements() -> list[str]:
    """The loading environment, whatever the version's format: :data:`REQUIREMENTS` pinned to the versions that
    logged it (given, since MLflow's inference would otherwise load the model in a subprocess to find them)."""
    pins = []
    for dist in REQUIREMENTS:
        try:
            pins.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(dist)
    return pins


def save_version(version: registry.ModelVersion, model_file: bytes, path: Path) -> None:
    """Write ``version`` (its model file's bytes given) as an MLflow pyfunc model at ``path``; a
    :class:`~rayline.errors.ModelExportError` for a version that is no ONNX file and does not export to one."""
    import mlflow.pyfunc

    from rayline.ray_workloads.registration import mlflow_pyfunc as code
    from rayline.ray_workloads.registration.onnx_export import version_onnx

    onnx = version_onnx(version, model_file)
    with tempfile.TemporaryDirectory(prefix="rayline-mlflow-") as tmp:
        staged = Path(tmp)
        artifacts = {
            code.VERSION_ARTIFACT: _write(staged / layout.VERSION_FILE, version.model_dump_json(indent=2).encode()),
            code.MODEL_ARTIFACT: _write(staged / ONNX_FILE, onnx),
        }
        with warnings.catch_warnings():
            # no input example on purpose: MLflow would load and run the model to check it, at every mirror
            warnings.filterwarnings("ignore", ".*An input example was not provided", UserWarning)
            mlflow.pyfunc.save_model(
                path=str(path),
                python_model=str(PYFUNC_CODE),
                artifacts=artifacts,
                signature=signature(),
                pip_requirements=pip_requirements(),
                metadata={
                    "rayline.name": version.name,
                    "rayline.version": version.version,
                    "rayline.uri": version.uri,
                    "rayline.format": version.model_spec.format,
                },
            )


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
