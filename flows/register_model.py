"""Flow ``register-model``: register a model the user already has, whatever they saved it as."""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow

from rayline.ray_workloads.registration.outside_models import IMAGENET, RegisterModelConfig, RegisterModelResult
from rayline.tasks.outside_models import register_outside_model


@flow(name="register-model")
def register_model(
    name: str,
    weights_uri: str,
    arch: str | None = None,
    format: Literal["state_dict", "torchscript", "torch_export", "onnx"] | None = None,
    factory: str | None = None,
    factory_kwargs: dict[str, Any] | None = None,
    code: str | None = None,
    sidecar: str | None = None,
    classes: str = IMAGENET,
    preprocess: Literal["imagenet", "squash"] = "imagenet",
    resize: int | None = None,
    crop: int | None = None,
    draft: bool = True,
    samples: str | None = None,
    alias: str | None = None,
) -> RegisterModelResult:
    """Check the model file ``weights_uri`` and register it as a new version of ``name``.

    A state dict names its module: ``arch`` (a torchvision name or
    ``timm:<name>``) or ``factory`` (``package.module:callable`` called with
    ``factory_kwargs``; ``code``: its local package folder, shipped to Ray). A
    TorchScript, ``.pt2`` or ONNX file is the whole model (``format`` is
    detected); ``sidecar``: a JSON file with its ``classes`` and ``image`` spec.

    ``classes``: ``imagenet`` or a file/S3 URI with one class name a line.
    ``preprocess``: ``imagenet`` (the architecture's own torchvision weights
    entry's transform) or ``squash``; ``resize``/``crop`` override its sizes
    (a size the architecture cannot take, such as a ViT's crop other than 224, is refused); ``draft`` (the
    default) decodes large JPEGs at a reduced scale (faster, within images.DRAFT_MAX_MEAN_ABS_DIFF of full
    decoding), ``False`` fully. ``samples``: a folder or prefix of a few of the model's own images, kept with
    the version to judge its execution plans on. ``alias``: e.g. ``champion`` (nightly inference uses it), or
    ``challenger`` to canary it.
    """
    return register_outside_model(
        RegisterModelConfig(
            name=name,
            arch=arch,
            weights_uri=weights_uri,
            format=format,
            factory=factory,
            factory_kwargs=factory_kwargs or {},
            code=code,
            sidecar=sidecar,
            classes=classes,
            preprocess=preprocess,
            resize=resize,
            crop=crop,
            draft=draft,
            samples=samples,
            alias=alias,
        )
    )
