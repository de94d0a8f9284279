"""A model that overflows fp16 on some images only, and those images: a real overflow, no mock.

A SmallCNN with random weights, except channel 0 of its first block: it
measures how far a 3×3 window is above a threshold brightness, times
``SCALE``, and the second block divides it by ``SCALE`` again. In fp32 the
network answers as any SmallCNN does. Under fp16 autocast a window of a
bright image (pixels near 255) reaches ``0.8 × SCALE`` = 160,000, past
fp16's 65,504: inf, then NaN. A dim image (no pixel above ``DIM_PEAK``)
stays below the threshold and leaves channel 0 at exactly 0 in both
precisions, where fp16 agrees with fp32 and passes the plan's gate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from rayline.models import registry
from rayline.ray_workloads.architectures.build import build_model, state_dict_bytes
from rayline.ray_workloads.data.images import decode_image
from rayline.seed import png_bytes
from rayline.specs import ImageSpec, ModelSpec

if TYPE_CHECKING:
    from torch import nn

SPEC = ModelSpec(num_classes=10, width=8)
IMAGE = ImageSpec(crop=32)
SCALE = 2e5  # its weights (SCALE / 27) and bias (-0.2 SCALE) stay within fp16; a bright window's output does not
THRESHOLD = 0.2  # of the normalised pixel (-1 to 1): 153 of 255
DIM_PEAK, BRIGHT_PEAK = 140, 255


def overflowing_small_cnn(seed: int = 0) -> nn.Module:
    """The SmallCNN above, in eval mode, not yet prepared for inference (as a registry stores it)."""
    import torch

    torch.manual_seed(seed)
    model = build_model(SPEC).eval()
    conv, norm = model.features[0][0], model.features[0][1]
    with torch.no_grad():
        conv.weight[0] = 1 / 27  # the window's mean brightness
        norm.running_mean[0], norm.running_var[0] = 0.0, 1.0 - norm.eps
        norm.weight[0], norm.bias[0] = SCALE, -SCALE * THRESHOLD
        model.features[1][0].weight[:, 0] /= SCALE
    return model


def digit_pngs(indices: range, peak: int) -> list[tuple[str, bytes]]:
    """scikit-learn digits as 32 px RGB PNGs whose brightest pixel is ``peak``: (key, bytes)."""
    from sklearn.datasets import load_digits

    images = load_digits().images
    named = []
    for index in indices:
        gray = Image.fromarray((images[index] * (peak / 16.0)).astype(np.uint8))
        rgb = gray.resize((IMAGE.crop, IMAGE.crop), Image.Resampling.BILINEAR).convert("RGB")
        named.append((f"peak{peak:03d}/digit-{index:04d}.png", png_bytes(np.asarray(rgb))))
    return named


def decoded(pngs: list[tuple[str, bytes]]) -> np.ndarray:
    """The PNGs as the model's input (N, 3, 32, 32), decoded as a night decodes them."""
    return np.stack([decode_image(data, IMAGE) for _, data in pngs])


def register_overflowing(name: str = "overflow") -> registry.ModelVersion:
    """The model, registered as ``name``'s champion."""
    version = registry.register(
        name,
        state_dict_bytes(overflowing_small_cnn()),
        model_spec=SPEC,
        image_spec=IMAGE,
        classes=[str(i) for i in range(SPEC.num_classes)],
        metrics={},
        code_version="test",
    )
    registry.set_alias(name, registry.CHAMPION, version.version, "test")
    return version
