"""A registered version as one ONNX file, for what runs neither rayline nor torch (the MLflow mirror's models).

An ONNX version is its own file. Every other format is loaded as rayline loads it (a state dict into the
module rayline builds, a factory's class from its shipped code, TorchScript, a ``.pt2`` program) and exported
with torch's TorchScript-based exporter (nothing beyond torch), its batch dimension dynamic unless the file
fixed one. A factory's code is needed here, where it is, and never where the ONNX file runs.

The export is then run by ONNX Runtime beside rayline's own model on a few seeded inputs, at a batch size
other than the one it was traced at: a trace that baked in a shape, or followed one branch of the model's
control flow, answers otherwise and is refused (:class:`ModelExportError`) rather than published.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from rayline.errors import ConfigError, ModelExportError
from rayline.extras import install_hint
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.execution.onnx_backend import export
from rayline.ray_workloads.execution.plan import softmax
from rayline.specs import ONNX, STATE_DICT, TORCH_EXPORT

CHECK_BATCH = 3  # the check's batch when the export's is dynamic: not the traced one (1)
# the largest difference of any class probability between the export and rayline's model: fp32 rounding differs
# by ~1e-6 (ResNet-18); a wrong shape or branch differs by far more
MAX_PROBABILITY_DIFF = 1e-4

Logits = Callable[[np.ndarray], np.ndarray]


def version_onnx(version: ModelVersion, model_file: bytes) -> bytes:
    """``version`` (``model_file``: its model file's bytes) as ONNX, checked against rayline's own answers."""
    spec = version.model_spec
    if spec.format == ONNX:
        return model_file
    module, reference, fixed_batch = _torch_model(version, model_file)
    size = version.image_spec.size
    try:
        data = _export(module, size, fixed_batch)
    except Exception as exc:  # the exporter fails in many classes on what it cannot express
        raise ModelExportError(
            f"{_named(version)} does not export to ONNX ({type(exc).__name__}: {str(exc)[:300]}); "
            "register an ONNX file of it (torch.onnx.export) to have it in MLflow"
        ) from exc
    _check(version, data, reference, fixed_batch or CHECK_BATCH)
    return data


def _named(version: ModelVersion) -> str:
    return f"{version.name} v{version.version} ({version.model_spec.describe()})"


def _torch_model(version: ModelVersion, model_file: bytes) -> tuple[nn.Module, Logits, int | None]:
    """The module to export, rayline's logits for the check, and the batch size the file fixed (None: any)."""
    spec = version.model_spec
    if spec.format == STATE_DICT:
        from rayline.ray_workloads.execution.interface import load_version

        loaded = load_version(version, device=torch.device("cpu"), optimize=False)
        assert loaded.module is not None  # a state dict is loaded into the module rayline builds
        return loaded.module, loaded.logits, None
    from rayline.ray_workloads.architectures.model_files import load_file_model

    file_model = load_file_model(spec.format, model_file, version.weights_uri)
    source = file_model.source
    module = _Program(source.module()) if spec.format == TORCH_EXPORT else source
    return module, file_model.logits, file_model.max_batch


class _Program(nn.Module):
    """A ``.pt2`` program's module for the exporter, which would call its ``train(False)``: an exported program
    is in eval mode already and refuses to switch."""

    def __init__(self, program: nn.Module) -> None:
        super().__init__()
        self.program = program

    def train(self, mode: bool = True) -> _Program:
        return self

    def forward(self, images: torch.Tensor) -> Any:
        return self.program(images)


def _export(module: nn.Module, size: int, fixed_batch: int | None) -> bytes:
    return export(module, torch.zeros(fixed_batch or 1, 3, size, size), dynamic_batch=fixed_batch is None)


def _check(version: ModelVersion, data: bytes, reference: Logits, batch: int) -> None:
    """Refuse ``data`` unless ONNX Runtime's probabilities match rayline's on ``batch`` seeded inputs."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ConfigError(
            f"checking a model's ONNX export needs ONNX Runtime, which is not installed: {install_hint('mlflow')}"
        ) from exc
    size = version.image_spec.size
    inputs = np.random.default_rng(0).standard_normal((batch, 3, size, size)).astype(np.float32)
    try:
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        exported = softmax(np.asarray(session.run(None, {"images": inputs})[0], dtype=np.float32))
    except Exception as exc:  # ONNX Runtime raises its own classes on a graph it cannot run
        raise ModelExportError(
            f"{_named(version)}'s ONNX export does not run in ONNX Runtime: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    expected = softmax(reference(inputs))
    difference = float(np.abs(exported - expected).max()) if exported.shape == expected.shape else float("inf")
    if not difference <= MAX_PROBABILITY_DIFF:
        raise ModelExportError(
            f"{_named(version)}'s ONNX export answers otherwise than the model: class probabilities differ by "
            f"up to {difference:.3g} on {batch} inputs (shapes {exported.shape} and {expected.shape}; at most "
            f"{MAX_PROBABILITY_DIFF:g} expected); register an ONNX file of it (torch.onnx.export) to have it in MLflow"
        )
