"""Flow ``register-model``: register a model the user already has (a state dict of any torchvision classifier)."""

from __future__ import annotations

from typing import Literal

from prefect import flow

from ray_workloads.register_model import IMAGENET, RegisterModelConfig, RegisterModelResult
from tasks.register_model import register_outside_model


@flow(name="register-model")
def register_model(
    name: str,
    arch: str,
    weights_uri: str,
    classes: str = IMAGENET,
    preprocess: Literal["imagenet", "squash"] = "imagenet",
    resize: int | None = None,
    crop: int | None = None,
    draft: bool = False,
    alias: str | None = None,
) -> RegisterModelResult:
    """Check ``weights_uri`` against ``arch`` and register it as a new version of ``name``.

    ``classes``: ``imagenet`` or a file/S3 URI with one class name a line.
    ``preprocess``: ``imagenet`` (the architecture's own torchvision weights
    entry's transform) or ``squash``; ``resize``/``crop`` override its sizes
    (a size the architecture cannot take, such as a ViT's crop other than 224, is refused); ``draft`` decodes
    large JPEGs at a reduced scale (faster, not equal to full decoding). ``alias``: e.g.
    ``champion`` (nightly inference uses it), or ``challenger`` to canary it.
    """
    return register_outside_model(
        RegisterModelConfig(
            name=name,
            arch=arch,
            weights_uri=weights_uri,
            classes=classes,
            preprocess=preprocess,
            resize=resize,
            crop=crop,
            draft=draft,
            alias=alias,
        )
    )
