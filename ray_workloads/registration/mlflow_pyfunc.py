"""rayline's MLflow pyfunc, logged as code: image bytes in, the version's classes out.

The registry mirror (``mlflow_models``) logs this file, which MLflow runs on load: no Python object is
pickled. Its artifacts are the version's own files: ``version.json``, its model file and, for a factory
shipped with ``--code``, its code zip. Images are decoded with the version's image spec, as nights and
serving do. Input: a DataFrame with a binary column ``image`` of encoded image files (or
``{"image": [...]}``); MLflow's scoring server takes them base64-encoded in JSON.
"""

import base64
import binascii
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mlflow.models import set_model
from mlflow.pyfunc.model import PythonModel, PythonModelContext

from rayline.errors import ImageDecodeError, InputDataError
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.data.images import decode_image
from rayline.ray_workloads.execution.interface import LoadedModel, load_version

# names of the logged artifacts (``context.artifacts`` keys)
VERSION_ARTIFACT = "version"
MODEL_ARTIFACT = "model"
CODE_ARTIFACT = "code"
IMAGE_COLUMN = "image"
OUTPUT_COLUMNS = ["class_index", "class_name", "confidence", "top_classes", "top_confidences", "error"]
TOP_K = 5
BATCH = 64  # images per forward pass: bounds the memory of a large input


def local_version(version: ModelVersion, artifacts: dict[str, str]) -> ModelVersion:
    """``version`` reading its model file (and factory code) from the local artifact copies."""
    spec = version.model_spec
    factory = spec.factory
    if factory is not None and factory.code_uri is not None:
        if CODE_ARTIFACT not in artifacts:
            raise InputDataError(
                f"{version.name} v{version.version} is factory {factory.describe()} with its code shipped, but the "
                f"MLflow model has no {CODE_ARTIFACT!r} artifact; expected the code zip logged with it"
            )
        spec = spec.model_copy(update={"factory": factory.model_copy(update={"code_uri": artifacts[CODE_ARTIFACT]})})
    return version.model_copy(update={"weights_uri": artifacts[MODEL_ARTIFACT], "model_spec": spec})


def image_bytes(model_input: Any) -> list[Any]:
    """The images of a DataFrame's ``image`` column, a Series, an array or a list."""
    if isinstance(model_input, pd.DataFrame):
        if IMAGE_COLUMN not in model_input.columns:
            raise InputDataError(
                f"expected a column {IMAGE_COLUMN!r} of encoded image files; got columns {list(model_input.columns)}"
            )
        return list(model_input[IMAGE_COLUMN])
    if isinstance(model_input, bytes | bytearray | str):
        return [model_input]
    if isinstance(model_input, dict) and IMAGE_COLUMN in model_input:
        return image_bytes(pd.DataFrame({IMAGE_COLUMN: list(np.atleast_1d(model_input[IMAGE_COLUMN]))}))
    return list(model_input)


def _as_bytes(value: Any) -> bytes | None:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            return value.encode()  # not base64: decoding it as an image fails with its own message
    return None


def classify(loaded: LoadedModel, version: ModelVersion, images: list[Any], top_k: int = TOP_K) -> pd.DataFrame:
    """One row per image: its class, confidence and top ``top_k``; ``error`` for one that does not decode."""
    decoded: dict[int, np.ndarray] = {}
    errors: dict[int, str] = {}
    for i, value in enumerate(images):
        try:
            decoded[i] = decode_image(_as_bytes(value), version.image_spec)
        except ImageDecodeError as exc:
            errors[i] = f"{type(exc).__name__}: {exc}"
    probabilities = np.zeros((len(images), len(version.classes)), dtype=np.float32)
    good = sorted(decoded)
    for start in range(0, len(good), BATCH):
        rows = good[start : start + BATCH]
        probabilities[rows] = loaded.probabilities(np.stack([decoded[i] for i in rows]))
    top = np.argsort(-probabilities, axis=1, kind="stable")[:, : max(1, min(top_k, len(version.classes)))]
    records: list[dict[str, Any]] = []
    for i, ranked in enumerate(top):
        if i in errors:
            nothing = {"class_index": -1, "class_name": None, "confidence": float("nan")}
            records.append({**nothing, "top_classes": [], "top_confidences": [], "error": errors[i]})
            continue
        records.append(
            {
                "class_index": int(ranked[0]),
                "class_name": version.classes[ranked[0]],
                "confidence": float(probabilities[i, ranked[0]]),
                "top_classes": [version.classes[j] for j in ranked],
                "top_confidences": [float(probabilities[i, j]) for j in ranked],
                "error": None,
            }
        )
    return pd.DataFrame.from_records(records, columns=OUTPUT_COLUMNS)


class RaylineClassifier(PythonModel):
    """A registered rayline version as an MLflow pyfunc (see the module's docstring)."""

    def load_context(self, context: PythonModelContext) -> None:
        stored = ModelVersion.model_validate_json(Path(context.artifacts[VERSION_ARTIFACT]).read_bytes())
        self.version = local_version(stored, context.artifacts)
        self.loaded = load_version(self.version)

    def predict(
        self, context: PythonModelContext, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        top_k = int((params or {}).get("top_k", TOP_K))
        return classify(self.loaded, self.version, image_bytes(model_input), top_k)


set_model(RaylineClassifier())
