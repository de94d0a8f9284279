"""What a register-model run is asked: one typed request, the same from the command line and the flow's form
to the stage (:func:`rayline.ray_workloads.registration.outside_models.run`), checked here alone. Plain
pydantic without torch or Prefect: the command line builds its options from the fields
(``rayline.cli.request_options``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from rayline.specs import check_model_name

IMAGENET = "imagenet"


class RegisterRequest(BaseModel):
    """A model the user already has, whatever they saved it as: what it is, its classes, its preprocessing."""

    name: str = Field(description="Registry name, e.g. photos (lowercase letters, digits, '-').")
    weights_uri: str = Field(
        description="The model file or URI: a state dict (torch.save(model.state_dict(), …)), TorchScript, "
        "a torch.export .pt2 program or ONNX (detected from the content)."
    )
    arch: str | None = Field(
        None,
        description="For a state dict: any torchvision classifier (resnet50, efficientnet_b0, vit_b_16, …) or "
        "timm:<name> (timm.list_models()). Not for TorchScript/.pt2/ONNX: the file is the whole model.",
    )
    format: Literal["state_dict", "torchscript", "torch_export", "onnx"] | None = Field(
        None, description="state_dict, torchscript, torch_export or onnx; checked against the file's content."
    )
    factory: str | None = Field(
        None, description="For a state dict of your own class: package.module:callable returning the nn.Module."
    )
    factory_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="JSON keyword arguments of the factory, e.g. '{\"width\": 64}'."
    )
    code: str | None = Field(
        None, description="The factory's package folder, stored with the model and shipped to Ray (runtime_env)."
    )
    sidecar: str | None = Field(
        None,
        description='JSON file/URI: {"classes": [...], "image": {"mode": "resize_crop", "resize": 256, "crop": 224, '
        '"mean": […], "std": […]}} (docs/models.md).',
    )
    classes: str = Field(
        IMAGENET, description="'imagenet' (torchvision's 1,000 names) or a file or storage URI with one name a line."
    )
    preprocess: Literal["imagenet", "squash"] = Field(
        "imagenet",
        description="imagenet: the model's own evaluation transform (torchvision weights entry, timm config, or "
        "resize 256 / crop 224); squash: resize to a square.",
    )
    resize: int | None = Field(None, ge=4, le=4096, description="Shorter side before the centre crop (imagenet).")
    crop: int | None = Field(None, ge=4, le=1024, description="Side of the square the model sees.")
    draft: bool = Field(
        True,
        description="Decode JPEGs over twice the needed size at a reduced scale (faster the larger the photo, close "
        "to full decoding: docs/models.md), or fully: equal to torchvision's transforms().",
    )
    samples: str | None = Field(
        None,
        description="A folder or URI prefix of a few of the model's own images (the first 32 by key are kept): the "
        "execution plan's accuracy gate is judged on them. Without it, on stand-in photos.",
    )
    alias: str | None = Field(None, description="Alias to point at it: champion, or challenger to canary it.")

    @field_validator("name")
    @classmethod
    def _a_registry_name(cls, name: str) -> str:
        return check_model_name(name)
