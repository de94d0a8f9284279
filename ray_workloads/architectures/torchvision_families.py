"""Which classifiers rayline builds by name, where each keeps its head, and what input each accepts.

Every classifier ``torchvision.models.list_models`` names, plus the digits' small CNN. A name's family is the
torchvision module of its builder (``resnext50_32x4d`` → ``resnet``), so a new architecture of a known family
needs no entry: :data:`FAMILIES` says, per family, where the head is, how it is built and whether its input
size is fixed. Built with ``weights=None`` (no download); preprocessing and class names come from the weights
entry's metadata, which ships with the package.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rayline.errors import ConfigError
from rayline.specs import RESIZE_CROP, SMALL_CNN, ImageSpec

LIST_HINT = "python -c 'import torchvision; print(torchvision.models.list_models(module=torchvision.models))'"
SMALL_CNN_MIN_SIDE = 8  # three 2×2 max-pools


@dataclass(frozen=True)
class Family:
    """What rayline must know about a family of architectures beyond its builder."""

    name: str
    head: str  # dotted path of the classifier's last layer: a Linear, or a 1×1 Conv2d
    fixed_size: int | None = None  # the only input side the model built with weights=None accepts
    build_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # state-dict prefixes rayline never uses: auxiliary training heads a user's file may still hold
    auxiliary: tuple[str, ...] = ()


# googlenet and inception as torchvision builds them for its own weights: input re-normalised inside, no
# auxiliary heads (their tuple output would not train; a state dict of torchvision's weights has none or ignores them)
_AS_TORCHVISION_WEIGHTS = {"aux_logits": False, "transform_input": True, "init_weights": True}
# keyed by the torchvision module holding the builders
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("resnet", "fc"),  # resnet, resnext, wide_resnet
        Family("regnet", "fc"),
        Family("shufflenetv2", "fc"),
        Family("googlenet", "fc", build_kwargs=_AS_TORCHVISION_WEIGHTS, auxiliary=("aux1.", "aux2.")),
        Family("inception", "fc", build_kwargs=_AS_TORCHVISION_WEIGHTS, auxiliary=("AuxLogits.",)),
        Family("alexnet", "classifier.6"),
        Family("vgg", "classifier.6"),
        Family("mobilenetv2", "classifier.1"),
        Family("mobilenetv3", "classifier.3"),
        Family("efficientnet", "classifier.1"),
        Family("mnasnet", "classifier.1"),
        Family("densenet", "classifier"),
        Family("convnext", "classifier.2"),
        Family("squeezenet", "classifier.1"),  # a 1×1 Conv2d: one score map per class, then averaged
        Family("swin_transformer", "head"),  # v1 and v2 pad to their windows: any size runs
        # position embeddings (ViT) and attention grids (MaxViT) are sized for one input when built
        Family("vision_transformer", "heads.head", fixed_size=224),
        Family("maxvit", "classifier.5", fixed_size=224),
    )
}
SMALL_CNN_FAMILY = Family(SMALL_CNN, "head.3")


@functools.cache
def torchvision_names() -> tuple[str, ...]:
    """Every classifier torchvision builds (detection, segmentation and video models are elsewhere)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def family_of(arch: str) -> Family:
    """``arch``'s family; an unknown name is refused with close matches and how to list the known ones."""
    if arch == SMALL_CNN:
        return SMALL_CNN_FAMILY
    if arch not in torchvision_names():
        close = difflib.get_close_matches(arch, torchvision_names(), n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ConfigError(
            f"unknown model architecture {arch!r}{hint}: rayline builds {SMALL_CNN} and the "
            f"{len(torchvision_names())} classifiers torchvision lists: {LIST_HINT}"
        )
    import torchvision

    module = torchvision.models.get_model_builder(arch).__module__.rsplit(".", 1)[-1]
    try:
        return FAMILIES[module]
    except KeyError as exc:  # a torchvision release with a family this table does not know yet
        raise ConfigError(
            f"{arch} is a torchvision classifier of family {module!r}, which rayline has no entry for "
            f"(where its classifier head is, whether its input size is fixed): known families "
            f"{', '.join(sorted(FAMILIES))}"
        ) from exc


def build_torchvision(arch: str, num_classes: int) -> nn.Module:
    """``arch`` untrained, for ``num_classes``, never downloading weights."""
    import torchvision

    kwargs = dict(family_of(arch).build_kwargs)
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)  # type: ignore[no-any-return]


def without_auxiliary_heads(arch: str, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` less the auxiliary training heads rayline's build of ``arch`` does not have."""
    prefixes = family_of(arch).auxiliary
    if not prefixes:
        return state
    return {key: value for key, value in state.items() if not key.startswith(prefixes)}


def classifier_head(model: nn.Module, arch: str) -> tuple[nn.Module, str, nn.Linear | nn.Conv2d]:
    """(the module holding the classifier's last layer, its attribute name there, that layer)."""
    path = family_of(arch).head
    parent_path, _, name = path.rpartition(".")
    try:
        holder = model.get_submodule(parent_path) if parent_path else model
        layer = getattr(holder, name)
    except AttributeError as exc:
        raise ConfigError(f"{arch} has no classifier head at {path!r} (its family's entry in FAMILIES)") from exc
    if not isinstance(layer, nn.Linear | nn.Conv2d):
        raise ConfigError(
            f"{arch}'s classifier head {path!r}: expected a Linear or a 1×1 Conv2d, found {type(layer).__name__}"
        )
    return holder, name, layer


def head_classes(state: Mapping[str, Any], arch: str | None = None) -> int | None:
    """The class count a state dict's classifier head was trained for: the rows of ``arch``'s head
    weight, else of the last 2-D weight (the last Linear of most classifiers)."""
    if arch is not None:
        head = state.get(f"{family_of(arch).head}.weight")
        if isinstance(head, torch.Tensor):
            return int(head.shape[0])
    heads = [value for key, value in state.items() if key.endswith(".weight") and value.ndim == 2]
    return int(heads[-1].shape[0]) if heads else None


def replace_head(model: nn.Module, arch: str, num_classes: int) -> nn.Module:
    """Put a freshly initialised head for ``num_classes`` in place of ``arch``'s; returns the new head."""
    holder, name, old = classifier_head(model, arch)
    new: nn.Module
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    elif old.kernel_size == (1, 1):
        new = nn.Conv2d(old.in_channels, num_classes, kernel_size=1, bias=old.bias is not None)
    else:
        raise ConfigError(
            f"{arch}'s classifier head {family_of(arch).head!r}: expected a 1×1 Conv2d, found kernel {old.kernel_size}"
        )
    setattr(holder, name, new)
    return new


def weights_entry(arch: str) -> Any:
    """The torchvision weights entry ``arch``'s preprocessing and class names come from (metadata only):
    the default, unless the family's input size is fixed and the default wants another (``vit_h_14``'s
    is 518 px; rayline builds it for 224), then the first entry made for the size it takes."""
    family = family_of(arch)
    if arch == SMALL_CNN:
        raise ConfigError(f"{SMALL_CNN} has no torchvision weights entry: use --preprocess squash with it")
    import torchvision

    enum = torchvision.models.get_model_weights(arch)
    default = enum.DEFAULT
    if family.fixed_size is None:
        return default
    fitting = [e for e in (default, *enum) if int(e.transforms().crop_size[0]) == family.fixed_size]
    if not fitting:
        raise ConfigError(
            f"{arch} is built for {family.fixed_size}×{family.fixed_size} input but none of its torchvision "
            f"weights entries is: give --crop {family.fixed_size} and --resize"
        )
    return fitting[0]


def imagenet_image_spec(arch: str) -> ImageSpec:
    """The evaluation transform of ``arch``'s own torchvision weights entry (no download)."""
    transforms = weights_entry(arch).transforms()
    return ImageSpec(
        mode=RESIZE_CROP,
        resize=int(transforms.resize_size[0]),
        crop=int(transforms.crop_size[0]),
        interpolation=str(transforms.interpolation.value),
        mean=tuple(transforms.mean),
        std=tuple(transforms.std),
    )


def imagenet_classes(arch: str = "resnet50") -> list[str]:
    """torchvision's 1,000 ImageNet class names (shipped with the package)."""
    return list(weights_entry(arch).meta["categories"])


def check_input_size(arch: str, crop: int, resize: int | None = None) -> None:
    """Refuse an input size ``arch`` cannot take, naming the size it needs, before any cluster time.
    ``crop``: the side of the square the model sees; ``resize``: the shorter side before the crop."""
    fixed = family_of(arch).fixed_size
    if fixed is not None:
        if crop != fixed:
            raise ConfigError(
                f"{arch} takes only {fixed}×{fixed} input (its size is fixed when built), but the image spec "
                f"gives {crop}×{crop}: it needs crop {fixed} (register-model: --crop {fixed}, or no --crop)"
            )
        if resize is not None and resize < fixed:
            raise ConfigError(
                f"{arch} takes only {fixed}×{fixed} input, but --resize {resize} makes the shorter side smaller "
                f"than that crop: use a --resize of at least {fixed}"
            )
    smallest = SMALL_CNN_MIN_SIDE if arch == SMALL_CNN else int(weights_entry(arch).meta["min_size"][0])
    if crop < smallest:
        raise ConfigError(
            f"{arch} needs input of at least {smallest}×{smallest}, but the image spec gives {crop}×{crop}"
        )
