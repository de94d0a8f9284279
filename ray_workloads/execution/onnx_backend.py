"""ONNX Runtime as a plan's backend for torch modules on CPUs: fp32, converted once per version and machine.

On a CPU without a bf16 path, fp32 is all there is, and ONNX Runtime's fused fp32 kernels ran ResNets
1.2-1.4x faster than torch's eager fp32 on one thread (bench/README.md): a candidate measured and gated like
any other, with the ``rayline[onnx]`` extra. Its CPU provider has no bf16 kernels worth measuring, so it is
an fp32 candidate only. The module is exported once (torch's TorchScript-based exporter: a second or two for
a ResNet-50, no extra dependency) and the ``.onnx`` file is stored beside the plan that chose it; later
actors and Serve replicas read it and build a session (well under a second).
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rayline import storage

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rayline.ray_workloads.execution.plan import Logits

MODEL_FILE = "model.onnx"
OPSET = 17


def export(module: nn.Module, example: torch.Tensor, dynamic_batch: bool) -> bytes:
    """``module`` traced on ``example`` by torch's TorchScript-based exporter (the light one: nothing beyond
    torch) as one ONNX file, input ``images`` and output ``logits``, their batch dimension dynamic or not."""
    import torch

    dynamic = {"images": {0: "batch"}, "logits": {0: "batch"}} if dynamic_batch else None
    with tempfile.TemporaryDirectory(prefix="rayline-onnx-") as folder, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        path = Path(folder) / MODEL_FILE
        torch.onnx.export(
            module,
            (example,),
            str(path),
            input_names=["images"],
            output_names=["logits"],
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
        )
        return path.read_bytes()


class OnnxModel:
    """A module as an ONNX graph, run by ONNX Runtime on this process's torch threads."""

    PACKAGE = "onnxruntime"  # what must be installed for it to be a candidate

    def __init__(self, data: bytes, prepare_s: float) -> None:
        self.data = data
        self.prepare_s = prepare_s  # exporting, or reading a stored one, and building sessions

    @classmethod
    def convert(cls, module: nn.Module, probe: np.ndarray) -> OnnxModel:
        """``module`` exported on one probe image, the batch dimension left dynamic."""
        import torch

        began = time.perf_counter()
        data = export(module, torch.from_numpy(np.ascontiguousarray(probe[:1])), dynamic_batch=True)
        return cls(data, time.perf_counter() - began)

    @classmethod
    def load(cls, uri: str) -> OnnxModel:
        """The model stored under ``uri`` (a folder holding :data:`MODEL_FILE`) by :meth:`save`."""
        began = time.perf_counter()
        data = storage.read_bytes(storage.join(uri, MODEL_FILE))
        return cls(data, time.perf_counter() - began)

    def save(self, uri: str) -> None:
        storage.write_bytes_atomic(storage.join(uri, MODEL_FILE), self.data)

    def run(self, precision: str) -> Logits:
        """Logits in fp32 (the only precision it is a candidate in) on this process's torch threads."""
        if precision != "fp32":
            raise ValueError(f"ONNX Runtime runs a converted module in fp32 only, not {precision}")
        import onnxruntime as ort
        import torch

        began = time.perf_counter()
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.inter_op_num_threads = 1
        session: Any = ort.InferenceSession(self.data, sess_options=options, providers=["CPUExecutionProvider"])
        self.prepare_s += time.perf_counter() - began

        def run(batch: np.ndarray) -> np.ndarray:
            outputs = session.run(None, {"images": np.ascontiguousarray(batch, dtype=np.float32)})
            return np.asarray(outputs[0], dtype=np.float32)

        return run
