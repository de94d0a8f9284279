"""timm classifiers by name (``--arch timm:<name>``), built offline with the user's weights: ``create_model(name,
pretrained=False)`` downloads nothing, and the preprocessing comes from the model's default pretrained config,
which timm keeps in its code. The head is timm's own (``get_classifier`` / ``reset_classifier``).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from rayline.errors import ConfigError
from rayline.extras import install_hint
from rayline.specs import IMAGENET_MEAN, IMAGENET_STD, RESIZE_CROP, TIMM_PREFIX, ImageSpec

INSTALL_HINT = install_hint("timm")


def timm_module() -> Any:
    try:
        import timm
    except ImportError as exc:
        raise ConfigError(f"--arch {TIMM_PREFIX}… needs timm, which is not installed: {INSTALL_HINT}") from exc
    return timm


def check_name(name: str) -> None:
    """Refuse a name timm does not know, suggesting the closest ones."""
    timm = timm_module()
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=4)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"--arch {TIMM_PREFIX}{name}: timm {timm.__version__} has no model {name!r}{hint}")


def build(name: str, num_classes: int) -> nn.Module:
    """The architecture with random weights and ``num_classes`` outputs; nothing is downloaded."""
    check_name(name)
    model: nn.Module = timm_module().create_model(name, pretrained=False, num_classes=num_classes)
    return model


def _config(name: str) -> dict[str, Any]:
    check_name(name)
    cfg = timm_module().models.get_pretrained_cfg(name)
    return dict(cfg.to_dict()) if cfg is not None else {}


def image_spec(name: str) -> ImageSpec:
    """The model's own evaluation transform: resize to crop / crop_pct, centre crop, its mean and std."""
    cfg = _config(name)
    crop = int(cfg.get("input_size", (3, 224, 224))[-1])
    crop_pct = float(cfg.get("crop_pct") or 0.875)
    interpolation = str(cfg.get("interpolation") or "bilinear")
    return ImageSpec(
        mode=RESIZE_CROP,
        resize=max(crop, math.floor(crop / crop_pct)),
        crop=crop,
        interpolation=interpolation if interpolation in ("bilinear", "bicubic", "nearest") else "bilinear",
        mean=tuple(cfg.get("mean") or IMAGENET_MEAN),
        std=tuple(cfg.get("std") or IMAGENET_STD),
    )


def fixed_input_size(name: str) -> int | None:
    """The side a model with a fixed input (ViT-style position embeddings) needs; None if any fits."""
    cfg = _config(name)
    return int(cfg["input_size"][-1]) if cfg.get("fixed_input_size") else None


def head_classes(state: Mapping[str, Any], name: str) -> int | None:
    """The class count of ``state``'s classifier, found by the state-dict prefix (``fc``, ``head.fc``…) the
    model's config names."""
    key = _config(name).get("classifier")
    if isinstance(key, (tuple, list)):
        key = key[0]
    weight = state.get(f"{key}.weight") if key else None
    return int(weight.shape[0]) if weight is not None and weight.ndim >= 1 else None


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """timm's own head reset: a fresh classifier for ``num_classes``; returns it."""
    model.reset_classifier(num_classes)  # type: ignore[operator]
    head: nn.Module = model.get_classifier()  # type: ignore[operator]
    return head
