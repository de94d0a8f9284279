"""Model architectures and safe weight loading.

A small CNN suited to the digits (the demo default) and real torchvision
classifiers by name, always built with ``weights=None`` (nothing is
downloaded at run time) and the class count from the data. Weights come from
a file or S3 URI and are loaded with ``torch.load(weights_only=True)``: a
checkpoint that needs arbitrary unpickling is refused.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from pydantic import BaseModel, Field
from torch import nn

from rayline import storage
from rayline.errors import ConfigError, InputDataError

SMALL_CNN = "small_cnn"
TORCHVISION_ARCHS = ("resnet18", "resnet34", "resnet50", "resnet152", "mobilenet_v3_small", "mobilenet_v3_large")


class UnsafeCheckpointError(InputDataError):
    """A checkpoint that is not plain tensors (pickled code/objects) was refused."""


class ModelSpec(BaseModel):
    """What to build: the architecture, its width and the number of classes."""

    arch: str = SMALL_CNN
    num_classes: int = Field(10, ge=2)
    width: int = Field(32, ge=4, le=512, description="Base channel count (small_cnn only).")
    dropout: float = Field(0.1, ge=0, lt=1)


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head; input (N, 3, H, W) with H, W >= 8."""

    def __init__(self, num_classes: int, width: int = 32, dropout: float = 0.1) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width))
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(4 * width, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # type: ignore[no-any-return]


def build_model(spec: ModelSpec) -> nn.Module:
    """Construct an untrained model (no download, ever)."""
    if spec.arch == SMALL_CNN:
        return SmallCNN(spec.num_classes, spec.width, spec.dropout)
    if spec.arch in TORCHVISION_ARCHS:
        import torchvision

        return torchvision.models.get_model(spec.arch, weights=None, num_classes=spec.num_classes)  # type: ignore[no-any-return]
    known = ", ".join((SMALL_CNN, *TORCHVISION_ARCHS))
    raise ConfigError(f"unknown model architecture {spec.arch!r}; known: {known}")


def state_dict_bytes(model: nn.Module) -> bytes:
    """Serialise weights only (tensors), the format :func:`load_state_dict` accepts."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    return buffer.getvalue()


def load_state_dict(uri: str) -> dict[str, Any]:
    """Read a state dict from a file or S3 URI without unpickling arbitrary objects."""
    return state_dict_from_bytes(storage.read_bytes(uri), uri)


def state_dict_from_bytes(data: bytes, uri: str) -> dict[str, Any]:
    """Parse a serialised state dict, refusing anything but tensors; ``uri`` names it in errors."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # keep torch's one line naming the offending global, drop its advice to disable the check
        detail = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line.upper()), "")
        raise UnsafeCheckpointError(
            f"refusing checkpoint {uri}: it holds pickled objects, not just tensors. {detail}".strip()
        ) from exc
    except Exception as exc:
        raise InputDataError(f"checkpoint {uri} is unreadable: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UnsafeCheckpointError(f"refusing checkpoint {uri}: expected a mapping of names to tensors")
    return state


def load_model(spec: ModelSpec, weights_uri: str) -> nn.Module:
    """Build ``spec`` and load weights from ``weights_uri``; shape mismatches are named."""
    model = build_model(spec)
    state = load_state_dict(weights_uri)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise InputDataError(f"weights at {weights_uri} do not fit {spec.arch}: {exc}") from exc
    return model.eval()


def prepare_for_inference(model: nn.Module) -> nn.Module:
    """The same model (same weights, outputs equal to ~1e-7), cheaper to run for inference.

    Batch norms are folded into the convolutions before them and the weights
    go channels-last, the layout of oneDNN's fast CPU convolutions. Measured
    on this project's 2-core machines: ~3.5x fewer CPU seconds per image for
    ``small_cnn``, about the same for resnet18 and mobilenet_v3_small at
    32 px. Feed it channels-last input. A model that cannot be traced is only
    re-laid out.
    """
    from torch.fx.experimental.optimization import fuse

    try:
        model = fuse(model)  # eval mode only: folds running statistics into the conv weights
    except Exception:  # e.g. data-dependent control flow; folding is an optimisation, not a requirement
        pass
    return model.to(memory_format=torch.channels_last)
