"""A user's file exported with a fixed batch (torch.export or ONNX without a dynamic batch dimension) answers any
number of images: a single /predict request, or a night's leftover block, is padded to the file's batch."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from rayline.ray_workloads.architectures.model_files import ONNX, TORCH_EXPORT, load_file_model

pytestmark = pytest.mark.unit

FIXED = 2


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)]
    return torch.nn.Sequential(*layers).eval()


def _exported(net: torch.nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(net, (torch.randn(FIXED, 3, 16, 16),)), buffer)
    return buffer.getvalue()


def _onnx(net: torch.nn.Module) -> bytes:
    pytest.importorskip("onnxruntime")  # the onnx extra (in dev)
    buffer = io.BytesIO()
    torch.onnx.export(net, (torch.randn(FIXED, 3, 16, 16),), buffer, input_names=["input"], dynamo=False)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", [TORCH_EXPORT, ONNX])
@pytest.mark.parametrize("images", [1, 3, 5])
def test_a_fixed_batch_file_answers_any_number_of_images(fmt: str, images: int) -> None:
    net = _net()
    data = _exported(net) if fmt == TORCH_EXPORT else _onnx(net)
    model = load_file_model(fmt, data, f"model.{fmt}")
    assert model.max_batch == FIXED, "the file's batch is read from it"
    batch = np.random.default_rng(0).standard_normal((images, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        expected = net(torch.from_numpy(batch)).numpy()
    logits = model.logits(batch)
    assert logits.shape == (images, 3)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
