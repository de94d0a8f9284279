"""Model architectures and safe weight loading.

The modules rayline loads a state dict into: a small CNN for the digits, torchvision classifiers
(``torchvision_families``), timm models (``timm_models``) and the user's own class (``factory_models``),
built without pretrained weights (nothing is downloaded at run time), the class count from the data.
Weights are loaded with ``torch.load(weights_only=True)``: a checkpoint that needs arbitrary unpickling is
refused. Code-free files (TorchScript, ``.pt2``, ONNX) have no module to build: ``model_files`` runs them.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any

import torch
from torch import nn

from rayline import storage
from rayline.errors import InferenceOnlyFormat, InputDataError, UnsafeCheckpointError, WeightsMismatchError
from rayline.ray_workloads.architectures import factory_models, timm_models
from rayline.ray_workloads.architectures.model_files import described
from rayline.ray_workloads.architectures.torchvision_families import (
    build_torchvision,
    check_input_size,
    classifier_head,
    family_of,
    head_classes,
    imagenet_classes,
    imagenet_image_spec,
    replace_head,
    without_auxiliary_heads,
)
from rayline.specs import SMALL_CNN, ModelSpec

__all__ = [
    "SMALL_CNN",
    "ModelSpec",
    "build_model",
    "check_input_size",
    "classifier_head",
    "family_of",
    "fine_tune_model",
    "head_classes",
    "imagenet_classes",
    "imagenet_image_spec",
    "load_model",
]
_EXPORT_HINT = "Export the weights alone and register that file: torch.save(model.state_dict(), 'weights.pt')"


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
    if spec.inference_only:
        raise InferenceOnlyFormat(
            f"{described(spec.format)} is an inference-only format: rayline runs it in nights and "
            "behind /predict but cannot rebuild its module to fine-tune it; register the model as a state dict "
            "with --arch (torchvision or timm:<name>) or --factory"
        )
    if spec.arch == SMALL_CNN:
        return SmallCNN(spec.num_classes, spec.width, spec.dropout)
    if spec.timm_name is not None:
        return timm_models.build(spec.timm_name, spec.num_classes)
    if spec.factory is not None:
        return factory_models.build(spec.factory, spec.num_classes)
    return build_torchvision(spec.arch, spec.num_classes)


def strip_auxiliary_heads(spec: ModelSpec, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` less the training-only heads (Inception's AuxLogits…) rayline's build of ``spec`` lacks."""
    if spec.timm_name is not None or spec.factory is not None:
        return state
    return without_auxiliary_heads(spec.arch, state)


def state_head_classes(spec: ModelSpec, state: dict[str, Any], model: nn.Module | None = None) -> int | None:
    """The class count of ``state``'s classifier, read where ``spec``'s family keeps it."""
    if spec.timm_name is not None:
        return timm_models.head_classes(state, spec.timm_name)
    if spec.factory is not None:
        if model is None:
            return head_classes(state)
        found = factory_models._last_classifier(model)
        key = f"{next(p for p, m in model.named_modules() if m is found[2])}.weight" if found else None
        weight = state.get(key) if key else None
        return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else head_classes(state)
    return head_classes(state, spec.arch)


def new_head(model: nn.Module, spec: ModelSpec, num_classes: int) -> nn.Module:
    """A freshly initialised classifier for ``num_classes`` in place of ``spec``'s; returns it."""
    if spec.timm_name is not None:
        return timm_models.replace_head(model, num_classes)
    if spec.factory is not None:
        return factory_models.replace_head(model, num_classes)
    return replace_head(model, spec.arch, num_classes)


def fine_tune_model(
    parent: ModelSpec, state: dict[str, Any], uri: str, num_classes: int, freeze_backbone: bool = False
) -> nn.Module:
    """The parent's architecture with its weights ``state`` (from ``uri``) and a new head for ``num_classes``.

    With ``freeze_backbone`` only the head keeps ``requires_grad``; hand the optimizer
    :func:`trainable_parameters` and keep frozen batch norms in eval mode while training
    (:func:`freeze_batchnorm_statistics`).
    """
    model = build_model(parent)
    state = strip_auxiliary_heads(parent, state)
    check_state_dict(parent, state, uri, model)
    model.load_state_dict(state)
    new = new_head(model, parent, num_classes)
    if freeze_backbone:
        model.requires_grad_(False)
        new.requires_grad_(True)
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should get: a frozen backbone's are left out."""
    return [p for p in model.parameters() if p.requires_grad]


def freeze_batchnorm_statistics(model: nn.Module) -> int:
    """Put every batch norm whose parameters are all frozen in eval mode; returns how many.

    ``model.train()`` switches them back to batch statistics, which would keep updating a frozen
    backbone's running means on the new data (the head would learn on features that drift from
    those it is served with). Call after each ``model.train()``.
    """
    frozen = 0
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            parameters = list(module.parameters())
            if parameters and not any(p.requires_grad for p in parameters):
                module.eval()
                frozen += 1
    return frozen


def state_dict_bytes(model: nn.Module | dict[str, Any]) -> bytes:
    """Serialise weights only (tensors), the format :func:`load_state_dict` accepts."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in state.items()}, buffer)
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
            f"refusing checkpoint {uri}: it holds pickled objects (a whole pickled model?), not just tensors. "
            f"{detail} {_EXPORT_HINT}".replace("  ", " ")
        ) from exc
    except Exception as exc:  # torch.load fails in many classes on bytes that are no checkpoint
        raise InputDataError(f"checkpoint {uri} is unreadable: {type(exc).__name__}: {exc}") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # the common {"state_dict": ..., "epoch": ...} wrapper of training scripts
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UnsafeCheckpointError(
            f"refusing checkpoint {uri}: expected a mapping of parameter names to tensors. {_EXPORT_HINT}"
        )
    return state


def check_state_dict(spec: ModelSpec, state: dict[str, Any], uri: str, model: nn.Module | None = None) -> None:
    """Raise :class:`WeightsMismatchError` naming what doesn't fit, unless ``state`` loads into ``spec``
    (``model``: ``spec`` already built)."""
    expected = (model if model is not None else build_model(spec)).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = sorted(
        f"{key} {tuple(state[key].shape)} (expected {tuple(expected[key].shape)})"
        for key in set(expected) & set(state)
        if tuple(state[key].shape) != tuple(expected[key].shape)
    )
    if not (missing or unexpected or wrong_shape):
        return
    parts = [f"weights at {uri} do not fit {spec.describe()} with {spec.num_classes} classes"]
    found = state_head_classes(spec, state, model)
    if found is not None and found != spec.num_classes:
        parts.append(f"the file's classifier head has {found} classes")
    for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", wrong_shape)):
        if keys:
            shown = ", ".join(keys[:8]) + (f", … ({len(keys)} in all)" if len(keys) > 8 else "")
            parts.append(f"{label}: {shown}")
    raise WeightsMismatchError("; ".join(parts))


def load_model(spec: ModelSpec, weights_uri: str) -> nn.Module:
    """Build ``spec`` and load weights from ``weights_uri``; shape mismatches are named."""
    model = build_model(spec)
    state = strip_auxiliary_heads(spec, load_state_dict(weights_uri))
    check_state_dict(spec, state, weights_uri, model)
    model.load_state_dict(state)
    return model.eval()


def prepare_for_inference(model: nn.Module) -> nn.Module:
    """The same model (same weights, outputs equal to ~1e-7), cheaper to run for inference.

    Batch norms are folded into the convolutions before them and the weights go channels-last, the
    layout of oneDNN's fast CPU convolutions (bench/README.md). Feed it channels-last input. A model
    that cannot be traced is only re-laid out.
    """
    from torch.fx.experimental.optimization import fuse

    # eval mode only: folds running statistics into the convs; one fx cannot trace is left unfolded (an optimisation)
    with contextlib.suppress(Exception):
        model = fuse(model)
    return model.to(memory_format=torch.channels_last)
