"""A model call failing for the machine (memory, the device) fails the night; one failing for its input is rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from rayline.errors import DeviceError, OutOfMemory, is_transient, model_call_fault
from rayline.ray_workloads.execution.interface import LoadedModel
from rayline.ray_workloads.execution.plan import PlanPolicy
from rayline.ray_workloads.nightly.predictor import PredictorUDF
from rayline.specs import ModelSpec

pytestmark = pytest.mark.unit

OUT_OF_MEMORY = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)"),
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: tried to allocate 3GB"),
    RuntimeError("CUDA error: out of memory"),
]
DEVICE = [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
]
INPUT = [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x100 and 128x10)"),
    ValueError("expected 4D input (got 3D input)"),
]


@pytest.mark.parametrize("exc", OUT_OF_MEMORY, ids=lambda e: f"{type(e).__name__}:{str(e)[:20]}")
def test_out_of_memory_is_the_machines_and_not_retried_in_place(exc: BaseException) -> None:
    fault = model_call_fault(exc, "a model call on 32 images")
    assert isinstance(fault, OutOfMemory) and not is_transient(fault)
    assert "32 images" in str(fault) and type(exc).__name__ in str(fault)


@pytest.mark.parametrize("exc", DEVICE, ids=lambda e: f"{type(e).__name__}:{str(e)[:20]}")
def test_a_device_error_is_the_machines_and_transient(exc: BaseException) -> None:
    fault = model_call_fault(exc, "a model call on 32 images")
    assert isinstance(fault, DeviceError) and is_transient(fault)


@pytest.mark.parametrize("exc", INPUT, ids=lambda e: type(e).__name__)
def test_an_input_shaped_failure_is_no_machine_fault(exc: BaseException) -> None:
    assert model_call_fault(exc, "a model call") is None


def _raising(exc: BaseException) -> Callable[[np.ndarray], np.ndarray]:
    def forward(images: np.ndarray) -> np.ndarray:
        raise exc

    return forward


def _udf(exc: BaseException) -> PredictorUDF:
    """The UDF's predict step over a model whose forward raises ``exc`` (no registry, no actor)."""
    udf = PredictorUDF.__new__(PredictorUDF)
    udf.top_k, udf.batch_size, udf.names = 2, 4, np.array([str(i) for i in range(10)], dtype=object)
    udf.device, udf.model = torch.device("cpu"), LoadedModel(ModelSpec(), None, _raising(exc))
    udf.plan_policy, udf.version_uri = PlanPolicy(mode="off"), "unused: the plan's choice is off"
    return udf


def _rows(n: int) -> dict[str, Any]:
    return {
        "image": np.zeros((n, 3, 8, 8), dtype=np.float32),
        "ok": np.ones(n, dtype=bool),
        "stage": np.array([None] * n, dtype=object),
        "error_type": np.array([None] * n, dtype=object),
        "error_message": np.array([None] * n, dtype=object),
    }


def test_a_model_call_failing_for_its_input_becomes_that_batchs_error_rows() -> None:
    rows = _rows(6)
    _udf(INPUT[0]).predict(rows)
    assert not rows["ok"].any() and set(rows["stage"]) == {"predict"} and set(rows["error_type"]) == {"RuntimeError"}


@pytest.mark.parametrize(("exc", "raised"), [(OUT_OF_MEMORY[0], OutOfMemory), (DEVICE[0], DeviceError)])
def test_a_model_call_failing_for_the_machine_raises_and_writes_no_rows(
    exc: BaseException, raised: type[Exception]
) -> None:
    rows = _rows(6)
    with pytest.raises(raised, match="not the input") as info:
        _udf(exc).predict(rows)
    assert info.value.__cause__ is exc
    assert rows["ok"].all(), "no sample was marked as failed"
