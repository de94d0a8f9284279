"""Register an outside model: a user's state dict for any torchvision classifier, as a new version.

The weights are read from a file or S3 URI with ``torch.load(weights_only=True)``
(a pickled whole model is refused with how to export a state dict), checked
against the architecture built for the class count (missing, unexpected and
mis-shaped keys are named), and stored tensors-only in the registry. The
version records where the weights came from (URI, SHA-256, size) instead of
a training data set, the class names (a file of one name a line, or
torchvision's ImageNet categories) and the image spec the model expects
(``imagenet``: its own torchvision weights entry's evaluation transform). An
input size the architecture cannot take (a ViT's crop other than 224) is
refused here, before any cluster time.

Registering the same bytes for the same name, architecture, classes and
image spec again returns the version already registered instead of a new
one, so a retried or repeated command is harmless.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, Field

from ray_workloads.architectures import (
    check_input_size,
    family_of,
    imagenet_classes,
    imagenet_image_spec,
    without_auxiliary_heads,
)
from ray_workloads.models import check_state_dict, state_dict_bytes, state_dict_from_bytes
from rayline import storage
from rayline.errors import ConfigError, InputDataError, StorageError
from rayline.lineage import DatasetRef
from rayline.models import registry
from rayline.specs import SMALL_CNN, SQUASH, ImageSpec, ModelSpec, WeightsSource

IMAGENET = "imagenet"


class RegisterModelConfig(BaseModel):
    name: str
    arch: str
    weights_uri: str = Field(description="A state dict file or S3 URI.")
    classes: str = Field(IMAGENET, description="'imagenet', or a file/S3 URI with one class name a line.")
    preprocess: Literal["imagenet", "squash"] = "imagenet"
    resize: int | None = Field(None, ge=4, le=4096, description="Override the shorter side before cropping.")
    crop: int | None = Field(None, ge=4, le=1024, description="Override the square side the model sees.")
    draft: bool = Field(False, description="Decode large JPEGs at a reduced scale (faster, not bit-equal).")
    alias: str | None = None
    code_version: str = "unknown"
    flow_run_id: str | None = None


class RegisterModelResult(BaseModel):
    version: registry.ModelVersion
    reused: bool = Field(description="The same weights were registered already: no new version.")
    alias_move: registry.AliasMove | None = None
    note: str | None = Field(None, description="Why the alias differs from the one asked for, if it does.")

    @property
    def weights_source(self) -> WeightsSource:
        """Where the version's weights came from (:func:`run` registers and reuses only versions that say)."""
        source = self.version.weights_source
        if source is None:
            raise StorageError(f"{self.version.uri} is an outside model's version but names no weights source")
        return source

    def lineage_inputs(self) -> list[DatasetRef]:
        """The weights file, pinned to its SHA-256."""
        source = self.weights_source
        return [DatasetRef(uri=source.uri, content_hash=source.sha256, facets={"size_bytes": source.size_bytes})]

    def lineage_outputs(self) -> list[DatasetRef]:
        """The version, pinned to its weights' SHA-256, with the alias it got."""
        moves = [self.alias_move.model_dump(mode="json")] if self.alias_move else []
        return [
            DatasetRef(
                uri=self.version.uri,
                content_hash=self.weights_source.sha256,
                facets={"moves": moves, "reused": self.reused},
            )
        ]


def read_classes(source: str, arch: str) -> list[str]:
    """Class names: torchvision's ImageNet categories, or one name a line from a file or S3 object."""
    if source == IMAGENET:
        return imagenet_classes(arch)
    try:
        text = storage.read_bytes(source).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputDataError(f"classes file {source} is not UTF-8 text (one class name a line)") from exc
    names = [line.strip() for line in text.splitlines() if line.strip()]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputDataError(f"classes file {source} names {', '.join(duplicates[:5])} more than once")
    if len(names) < 2:
        raise InputDataError(f"classes file {source} has {len(names)} class names; a classifier needs at least 2")
    return names


def image_spec_for(cfg: RegisterModelConfig) -> ImageSpec:
    """The spec ``--preprocess`` names, with ``--resize``/``--crop`` applied over it."""
    # squash too keeps the mean/std and interpolation the architecture's weights were trained with
    base = imagenet_image_spec(cfg.arch)
    crop = cfg.crop or base.crop
    update: dict[str, object] = {"crop": crop, "draft": cfg.draft}
    if cfg.preprocess == IMAGENET:
        # an explicit crop alone keeps the entry's resize/crop proportion (232/224 → 0.0357 margin)
        update["resize"] = cfg.resize or (base.resize * crop // base.crop if base.resize else crop)
    else:
        if cfg.resize is not None:
            raise ConfigError("--resize goes with --preprocess imagenet; squash resizes to --crop × --crop")
        update.update(mode=SQUASH, resize=None)
    check_input_size(cfg.arch, crop, cfg.resize)
    try:
        return ImageSpec.model_validate({**base.model_dump(), **update})
    except ValueError as exc:
        raise ConfigError(f"image spec for {cfg.name}: {exc}") from exc


def run(cfg: RegisterModelConfig) -> RegisterModelResult:
    if cfg.arch == SMALL_CNN:
        raise ConfigError(f"--arch {SMALL_CNN} is rayline's own digits model: train it with train-model")
    family_of(cfg.arch)  # an unknown name is refused before anything is read
    classes = read_classes(cfg.classes, cfg.arch)
    image = image_spec_for(cfg)
    spec = ModelSpec(arch=cfg.arch, num_classes=len(classes))
    data = storage.read_bytes(cfg.weights_uri)
    state = without_auxiliary_heads(cfg.arch, state_dict_from_bytes(data, cfg.weights_uri))
    check_state_dict(spec, state, cfg.weights_uri)
    # absolute, so lineage finds the file whatever folder it is read from
    source = WeightsSource(
        uri=storage.normalize(cfg.weights_uri), sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data)
    )
    existing = _same_registration(cfg.name, spec, image, classes, source)
    if existing is not None:
        version, reused = existing, True
    else:
        version = registry.register(
            cfg.name,
            state_dict_bytes(state),
            model_spec=spec,
            image_spec=image,
            classes=classes,
            metrics={},
            code_version=cfg.code_version,
            flow_run_id=cfg.flow_run_id,
            weights_source=source,
        )
        reused = False
    alias, note = cfg.alias, None
    expected: int | None | registry.Unchecked = registry.Unchecked.ANY  # an operator's --alias: wherever it is now
    if alias == registry.CHALLENGER and registry.alias_version(cfg.name, registry.CHAMPION) is None:
        # a challenger is canaried against the champion it serves next to: with none, it is the champion
        alias, note = registry.CHAMPION, f"{cfg.name} had no champion: v{version.version} is champion, not challenger"
        expected = None  # only while there still is none (AliasConflict if another run made one meanwhile)
    move = None
    if alias and registry.alias_version(cfg.name, alias) != version.version:
        move = registry.set_alias(cfg.name, alias, version.version, f"registered from {source.uri}", expected=expected)
    return RegisterModelResult(version=version, reused=reused, alias_move=move, note=note)


def _same_registration(
    name: str, spec: ModelSpec, image: ImageSpec, classes: list[str], source: WeightsSource
) -> registry.ModelVersion | None:
    for version in reversed(registry.list_versions(name)):
        ws = version.weights_source
        if (
            ws is not None
            and ws.sha256 == source.sha256
            and version.model_spec == spec
            and version.image_spec == image
            and version.classes == classes
        ):
            return version
    return None
