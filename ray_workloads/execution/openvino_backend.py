"""OpenVINO as a plan's backend on CPUs: the module converted once per version and machine, stored with its plan.

On a CPU with AVX-512-BF16 or AMX its bf16 kernels run ResNets faster than torch's autocast, and others
(ConvNeXt) slower (bench/README.md): a candidate measured and gated like any other, never a default, and
only with the ``rayline[openvino]`` extra. Converting takes seconds to tens of seconds, so the converted
model (OpenVINO IR: ``.xml`` graph and ``.bin`` weights, nothing executable) is stored beside the plan that
chose it, in a folder of the measuring actor's own, and later actors read and compile it instead (~1 s).
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rayline import storage

if TYPE_CHECKING:
    from torch import nn

    from rayline.ray_workloads.execution.plan import Logits

MODEL_FILES = ("model.xml", "model.bin")
OV_PRECISION = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


def _openvino() -> Any:
    """The ``openvino`` module, its telemetry declined before anything of it is imported."""
    _no_telemetry()
    import openvino

    return openvino


@functools.cache
def _no_telemetry() -> None:
    """Keep OpenVINO's converter from sending usage data: unless a user opted out, it forks processes that post
    to Google Analytics and writes a client ID under the home directory. A night's actor sends nothing anywhere,
    and a fork inside a Ray worker is unsafe. The telemetry is a process-wide singleton that the converter
    re-initialises (consenting again) only when it was made for another application name than its own."""
    ci = os.environ.get("CI")
    os.environ["CI"] = "true"  # the singleton made at import declines in CI: the only switch it reads
    try:
        import openvino.tools.ovc  # noqa: F401  (importing it makes the singleton, as "OpenVINO")
        from openvino_telemetry import Telemetry
    except ImportError:  # no telemetry package: the converter uses its own stub
        return
    finally:
        if ci is None:
            del os.environ["CI"]
        else:
            os.environ["CI"] = ci
    telemetry = Telemetry()
    telemetry.consent = False
    backend = getattr(telemetry, "backend", None)
    if backend is not None:
        backend.app_name = "OVC"  # the name convert_model initialises it with: it stays declined


class OpenVinoModel:
    """A module converted to OpenVINO: compiled per precision on demand, for this process's threads."""

    PACKAGE = "openvino"  # what must be installed for it to be a candidate

    def __init__(self, model: Any, prepare_s: float) -> None:
        self.model = model
        self.prepare_s = prepare_s  # converting, or reading and compiling a stored one: what an actor's start pays

    @classmethod
    def convert(cls, module: nn.Module, probe: np.ndarray) -> OpenVinoModel:
        """``module`` exported by ``torch.export`` (OpenVINO's own tracing goes through ``torch.jit.trace``,
        which this torch refuses) on two probe images, with the batch dimension left dynamic."""
        ov = _openvino()
        import torch

        began = time.perf_counter()
        example = torch.from_numpy(np.concatenate([probe[:1], probe[:1]]))  # two: a batch of one would be fixed
        batch = torch.export.Dim("batch", min=1, max=65_536)
        exported = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        return cls(ov.convert_model(exported), time.perf_counter() - began)

    @classmethod
    def load(cls, uri: str) -> OpenVinoModel:
        """The model stored at ``uri`` (a folder of :data:`MODEL_FILES`) by :meth:`save`."""
        ov = _openvino()
        began = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="rayline-openvino-") as folder:
            for name in MODEL_FILES:
                (Path(folder) / name).write_bytes(storage.read_bytes(storage.join(uri, name)))
            model = ov.Core().read_model(str(Path(folder) / MODEL_FILES[0]))
        return cls(model, time.perf_counter() - began)

    def save(self, uri: str) -> None:
        """Store the model under ``uri``; weights stay fp32 (the plan's precision is a compile-time hint)."""
        ov = _openvino()
        with tempfile.TemporaryDirectory(prefix="rayline-openvino-") as folder:
            ov.save_model(self.model, str(Path(folder) / MODEL_FILES[0]), compress_to_fp16=False)
            for name in MODEL_FILES:
                storage.write_bytes_atomic(storage.join(uri, name), (Path(folder) / name).read_bytes())

    def run(self, precision: str) -> Logits:
        """Logits in ``precision`` on this process's torch threads (one request at a time: Serve's health
        check may call while a batch runs)."""
        ov = _openvino()
        import torch

        config = {
            "INFERENCE_PRECISION_HINT": OV_PRECISION[precision],
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "PERFORMANCE_HINT": "LATENCY",
            # unpinned: each night actor is a process of its own, and OpenVINO pins every one to the same cores
            "ENABLE_CPU_PINNING": False,
        }
        began = time.perf_counter()
        compiled = ov.Core().compile_model(self.model, "CPU", config)
        self.prepare_s += time.perf_counter() - began
        request, lock = compiled.create_infer_request(), threading.Lock()

        def run(batch: np.ndarray) -> np.ndarray:
            with lock:
                return np.array(request.infer({0: np.ascontiguousarray(batch)})[0], dtype=np.float32)

        return run
