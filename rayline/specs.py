"""What a registered model is and how its images become input: typed, shared by every stage.

:class:`ModelSpec` says what to build (architecture, class count, width); :class:`ImageSpec` says how raw image
bytes become the model's input tensor. Both are stored in each version's ``version.json`` and carried typed by
:class:`rayline.models.registry.ModelVersion`, so the trainer, batch inference and serving read one object
instead of re-validating a dict each. :class:`SplitFractions` says how preprocess splits the samples; it and
the image spec are stored in a preprocess manifest (:mod:`rayline.storage.manifests`).

Two ways of sizing an image (``ImageSpec.mode``):

* ``squash``: resize to ``crop`` × ``crop`` ignoring the aspect ratio (the digits, stored square);
* ``resize_crop``: resize the shorter side to ``resize``, then take the ``crop`` × ``crop`` centre —
  torchvision's ImageNet evaluation transform (``ResNet50_Weights.IMAGENET1K_V2.transforms()``: 232 → 224).

This module is plain pydantic (no torch, no PIL), so the core can hold it.
"""

from __future__ import annotations

import re
from typing import Any, Literal, cast

from pydantic import BaseModel, Field, model_validator

from rayline.errors import ConfigError

DEFAULT_MAX_PIXELS = 40_000_000
SMALL_CNN = "small_cnn"
SQUASH = "squash"
RESIZE_CROP = "resize_crop"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DIGITS_IMAGE_SIZE = 32  # the side images are squashed to when no image spec is given
DEFAULT_MODEL_NAME = "digits"  # the registry name a request means when it names none
# the most often the train gate promotes a candidate that is no better than its champion on the test split's population
GATE_ALPHA = 0.05


# a registered model's name, and an alias's: one path segment and one Delta partition value
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def check_model_name(name: str) -> str:
    """``name`` if it can name a registered model, else a :class:`ConfigError` saying what a name may hold."""
    if not NAME_PATTERN.match(name):
        raise ConfigError(f"model name {name!r} must be lowercase letters, digits and '-' (at most 63)")
    return name


# Code-free model files: the file is the whole model (graph and weights); its ``arch`` is its format.
TORCHSCRIPT = "torchscript"
TORCH_EXPORT = "torch_export"
ONNX = "onnx"
FILE_FORMATS = (TORCHSCRIPT, TORCH_EXPORT, ONNX)
STATE_DICT = "state_dict"
TIMM_PREFIX = "timm:"
FACTORY = "factory"
ModelFormat = Literal["state_dict", "torchscript", "torch_export", "onnx"]


class FactoryRef(BaseModel):
    """A user's own ``nn.Module`` class: the callable that builds it, and where its code comes from."""

    target: str = Field(description="'package.module:callable', returning an nn.Module.")
    build_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the callable (--factory-kwargs, JSON)."
    )
    package: str | None = Field(None, description="The distribution that provides the module, when installed.")
    package_version: str | None = None
    code_uri: str | None = Field(
        None, description="The module's folder, zipped into the version: shipped to Ray with runtime_env py_modules."
    )
    code_sha256: str | None = None

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def top_level(self) -> str:
        """The top-level package the code defines (what ``py_modules`` ships)."""
        return self.module.partition(".")[0]

    def describe(self) -> str:
        version = f" ({self.package} {self.package_version})" if self.package else ""
        return f"{self.target}{version}"


class ModelSpec(BaseModel):
    """What to build: the architecture, its width and the number of classes.

    ``arch`` names where the model comes from: ``small_cnn``, a torchvision name, ``timm:<name>``, ``factory`` (with
    :attr:`factory`), or, for a code-free file, its format (``torchscript``, ``torch_export``, ``onnx``).
    """

    arch: str = SMALL_CNN
    num_classes: int = Field(10, ge=2)
    width: int = Field(32, ge=4, le=512, description="Base channel count (small_cnn only).")
    dropout: float = Field(0.1, ge=0, lt=1)
    factory: FactoryRef | None = None

    @model_validator(mode="after")
    def _factory_with_its_arch(self) -> ModelSpec:
        if (self.arch == FACTORY) != (self.factory is not None):
            raise ValueError("arch 'factory' goes with a factory reference, and only it")
        return self

    @property
    def format(self) -> ModelFormat:
        """How the stored file is read: a state dict for a module rayline builds, else the file's format."""
        return cast(ModelFormat, self.arch) if self.arch in FILE_FORMATS else "state_dict"

    @property
    def inference_only(self) -> bool:
        """A code-free file: rayline runs it but cannot rebuild its module to train it."""
        return self.format != STATE_DICT

    @property
    def timm_name(self) -> str | None:
        return self.arch[len(TIMM_PREFIX) :] if self.arch.startswith(TIMM_PREFIX) else None

    def describe(self) -> str:
        if self.factory is not None:
            return f"factory {self.factory.describe()}"
        return self.arch


class ImageSpec(BaseModel):
    """How raw images become model input; the same spec serves training, batch inference and serving."""

    mode: Literal["squash", "resize_crop"] = "squash"
    resize: int | None = Field(
        None, ge=4, le=4096, description="resize_crop: the shorter side is resized to this before cropping."
    )
    crop: int = Field(32, ge=4, le=1024, description="Side of the square the model sees.")
    interpolation: Literal["bilinear", "bicubic", "nearest"] = "bilinear"
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1)
    draft: bool = Field(
        True,
        description="JPEG: decode at a reduced DCT scale when the photo is over twice the size the spec needs "
        "(faster the larger the photo, within images.DRAFT_MAX_MEAN_ABS_DIFF of full decoding: docs/models.md); "
        "False decodes fully, equal to torchvision's transforms().",
    )

    @model_validator(mode="after")
    def _resize_fits_mode(self) -> ImageSpec:
        if self.mode == RESIZE_CROP:
            if self.resize is None:
                raise ValueError("resize_crop needs resize (the shorter side before the centre crop)")
            if self.resize < self.crop:
                raise ValueError(f"resize {self.resize} is smaller than crop {self.crop}")
        elif self.resize is not None:
            raise ValueError("squash takes no resize: the image is resized to crop × crop")
        return self

    @property
    def size(self) -> int:
        """Side of the model's square input (the crop)."""
        return self.crop

    @property
    def needed_side(self) -> int:
        """The shortest side a decoded image needs before resizing (for JPEG draft decoding)."""
        return self.resize if self.resize is not None else self.crop

    def describe(self) -> str:
        if self.mode == RESIZE_CROP:
            return f"resize {self.resize}, centre crop {self.crop}, {self.interpolation}"
        return f"squash to {self.crop}×{self.crop}, {self.interpolation}"


def squash(size: int) -> ImageSpec:
    """The digits' spec: square images resized to ``size`` × ``size``, normalised to [-1, 1]."""
    return ImageSpec(mode=SQUASH, crop=size)


class WeightsSource(BaseModel):
    """Where an outside model's weights came from (it has no training data set)."""

    uri: str
    sha256: str
    size_bytes: int


class SplitFractions(BaseModel):
    """How preprocess splits the samples (by a hash of each key); recorded in its manifest."""

    train: float = Field(0.8, ge=0, le=1)
    val: float = Field(0.1, ge=0, le=1)
    test: float = Field(0.1, ge=0, le=1)

    @model_validator(mode="after")
    def _sum_to_one(self) -> SplitFractions:
        total = self.train + self.val + self.test
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"split fractions must sum to 1, got {total:g}")
        return self


class ParentModel(BaseModel):
    """The registered version a fine-tuned model started from."""

    name: str
    version: int
    uri: str
    # how it was fine-tuned: retraining the child from this parent repeats it
    freeze_backbone: bool = False
