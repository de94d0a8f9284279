"""Register an outside model: whatever the user saved from their notebook, as a new version.

Accepted (``ModelSpec.arch`` records which): a state dict of a torchvision classifier (``--arch resnet50``),
a timm model (``--arch timm:<name>``) or the user's own class (``--factory package.module:build``), read
with ``torch.load(weights_only=True)`` (a pickled whole model is refused with how to export a state dict)
and checked against the module built for the class count; or a code-free file (TorchScript, ``.pt2``,
ONNX), detected from its content, loaded without unpickling arbitrary objects and probed with a forward
pass at the declared input size. A factory's code (installed on the cluster, or ``--code`` shipped with
the model) is imported on every node, then built, loaded and probed in a Ray task, so what the cluster
cannot run is refused here, naming the node.

The version records where the file came from (URI, SHA-256, size), the class names and the image spec
the model expects; an input size the architecture cannot take is refused before any cluster time. The
same bytes registered again as the same model, classes and image spec return the version already
registered, so a retried command is harmless.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, model_validator

from rayline import storage
from rayline.errors import ConfigError, ImageDecodeError, InputDataError, StorageError
from rayline.lineage import DatasetRef
from rayline.models import registry
from rayline.ray_workloads.architectures import factory_models, timm_models
from rayline.ray_workloads.architectures.build import (
    check_state_dict,
    state_dict_bytes,
    state_dict_from_bytes,
    strip_auxiliary_heads,
)
from rayline.ray_workloads.architectures.model_files import (
    FORMAT_NAMES,
    described,
    detect_format,
    load_file_model,
    onnx_input_shape,
)
from rayline.ray_workloads.architectures.torchvision_families import (
    check_input_size,
    family_of,
    imagenet_classes,
    imagenet_image_spec,
    torchvision_names,
)
from rayline.ray_workloads.data.images import decode_image
from rayline.ray_workloads.registration.request import IMAGENET, RegisterRequest
from rayline.specs import (
    FACTORY,
    FILE_FORMATS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    RESIZE_CROP,
    SMALL_CNN,
    SQUASH,
    FactoryRef,
    ImageSpec,
    ModelSpec,
    WeightsSource,
)

# the usual ImageNet evaluation transform, for a model rayline has no weights entry or config for
GENERIC_IMAGENET = ImageSpec(
    mode=RESIZE_CROP, resize=256, crop=224, interpolation="bilinear", mean=IMAGENET_MEAN, std=IMAGENET_STD
)


class RegisterModelConfig(RegisterRequest):
    """A registration as this run makes it: the request, and the code and flow run that registered it."""

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
        facets = {"moves": [self.alias_move.model_dump(mode="json")] if self.alias_move else [], "reused": self.reused}
        sha256 = self.weights_source.sha256
        return [DatasetRef(uri=self.version.uri, content_hash=sha256, facets=facets, stored_as="model")]


def _names_from(lines: list[str], source: str) -> list[str]:
    names = [line.strip() for line in lines if line.strip()]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputDataError(f"classes in {source} name {', '.join(duplicates[:5])} more than once")
    if len(names) < 2:
        raise InputDataError(f"classes in {source}: {len(names)} class names; a classifier needs at least 2")
    return names


def read_classes(source: str, arch: str) -> list[str]:
    """Class names: torchvision's ImageNet categories, or one name a line from a file or S3 object."""
    if source == IMAGENET:
        return imagenet_classes(arch if arch in torchvision_names() else "resnet50")
    try:
        text = storage.read_bytes(source).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputDataError(f"classes file {source} is not UTF-8 text (one class name a line)") from exc
    return _names_from(text.splitlines(), f"classes file {source}")


class Sidecar(BaseModel):
    """The small JSON file that travels with a code-free model: its classes and its preprocessing."""

    classes: list[str] | str | None = None
    image: ImageSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _resize_means_resize_crop(cls, data: Any) -> Any:
        # {"resize": 256, "crop": 224} is the usual evaluation transform: no one should have to name its mode
        image = data.get("image") if isinstance(data, dict) else None
        if isinstance(image, dict) and image.get("resize") is not None and "mode" not in image:
            data = {**data, "image": {**image, "mode": RESIZE_CROP}}
        return data


def read_sidecar(uri: str) -> Sidecar:
    try:
        return Sidecar.model_validate(json.loads(storage.read_bytes(uri)))
    except ValueError as exc:
        raise InputDataError(
            f"sidecar {uri}: {exc}; expected JSON like "
            '{"classes": ["cat", "dog"], "image": {"mode": "resize_crop", "resize": 256, "crop": 224, '
            '"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}'
        ) from exc


def base_image_spec(spec: ModelSpec) -> ImageSpec:
    """The architecture's own evaluation transform: torchvision's weights entry, timm's config, else ImageNet's."""
    if spec.timm_name is not None:
        return timm_models.image_spec(spec.timm_name)
    if spec.arch in torchvision_names():
        return imagenet_image_spec(spec.arch)
    return GENERIC_IMAGENET


def image_spec_for(
    cfg: RegisterModelConfig, spec: ModelSpec | None = None, sidecar: Sidecar | None = None
) -> ImageSpec:
    """The spec ``--preprocess`` (or the sidecar) names, with ``--resize``/``--crop`` applied over it."""
    spec = spec or ModelSpec(arch=cfg.arch or "", num_classes=2)
    # squash too keeps the mean/std and interpolation the architecture's weights were trained with
    base = sidecar.image if sidecar and sidecar.image else base_image_spec(spec)
    crop = cfg.crop or base.crop
    update: dict[str, object] = {"crop": crop, "draft": cfg.draft}
    if cfg.preprocess == IMAGENET:
        if base.mode == RESIZE_CROP:
            # an explicit crop alone keeps the base's resize/crop proportion (232/224 → 0.0357 margin)
            update["resize"] = cfg.resize or (base.resize * crop // base.crop if base.resize else crop)
        elif cfg.resize is not None:
            update.update(mode=RESIZE_CROP, resize=cfg.resize)
    else:
        if cfg.resize is not None:
            raise ConfigError("--resize goes with --preprocess imagenet; squash resizes to --crop × --crop")
        update.update(mode=SQUASH, resize=None)
    check_size(spec, crop, cfg.resize)
    try:
        return ImageSpec.model_validate({**base.model_dump(), **update})
    except ValueError as exc:
        raise ConfigError(f"image spec for {cfg.name}: {exc}") from exc


def check_size(spec: ModelSpec, crop: int, resize: int | None) -> None:
    """Refuse, before any cluster time, a size the architecture cannot take (fixed-size ViTs and the like)."""
    if spec.timm_name is not None:
        fixed = timm_models.fixed_input_size(spec.timm_name)
        if fixed is not None and crop != fixed:
            raise ConfigError(
                f"{spec.arch} takes only {fixed}×{fixed} input (its position embeddings are fixed), but the image "
                f"spec gives {crop}×{crop}: it needs crop {fixed} (register-model: --crop {fixed}, or no --crop)"
            )
    elif spec.arch in torchvision_names():
        check_input_size(spec.arch, crop, resize)


def model_spec_for(cfg: RegisterModelConfig, fmt: str, num_classes: int) -> ModelSpec:
    """What the file is, from the format and ``--arch``/``--factory``; contradictions are refused."""
    if fmt in FILE_FORMATS:
        if cfg.arch or cfg.factory:
            given = f"--arch {cfg.arch}" if cfg.arch else f"--factory {cfg.factory}"
            raise ConfigError(
                f"{cfg.weights_uri} is {described(fmt)}, the whole model: {given} names a module to "
                "build for a state dict; drop it"
            )
        return ModelSpec(arch=fmt, num_classes=num_classes)
    if cfg.arch and cfg.factory:
        raise ConfigError(f"give --arch {cfg.arch} or --factory {cfg.factory}, not both")
    if cfg.factory:
        module, _ = factory_models.parse_target(cfg.factory)
        ref = FactoryRef(target=cfg.factory, build_kwargs=cfg.factory_kwargs)
        package, version = (None, None) if cfg.code else factory_models.installed_package(module)
        return ModelSpec(
            arch=FACTORY,
            num_classes=num_classes,
            factory=ref.model_copy(update={"package": package, "package_version": version}),
        )
    if cfg.code or cfg.factory_kwargs:
        raise ConfigError("--code and --factory-kwargs go with --factory package.module:callable")
    if not cfg.arch:
        raise ConfigError(
            f"{cfg.weights_uri} is a state dict: say what it is the weights of with --arch (a torchvision name, "
            "or timm:<name>) or --factory package.module:callable"
        )
    if cfg.arch == SMALL_CNN:
        raise ConfigError(f"--arch {SMALL_CNN} is rayline's own digits model: train it with train-model")
    if cfg.arch.startswith("timm:"):
        timm_models.check_name(cfg.arch.removeprefix("timm:"))
    else:
        family_of(cfg.arch)  # an unknown name is refused before anything is read
    return ModelSpec(arch=cfg.arch, num_classes=num_classes)


def probe(loaded: Any, spec: ModelSpec, side: int, uri: str, declared: list[Any] | None = None) -> None:
    """A forward pass on two random images at the declared size: one finite score per class, or refused."""
    batch = np.random.default_rng(0).standard_normal((2, 3, side, side)).astype(np.float32)
    what = f"{uri} ({FORMAT_NAMES.get(spec.format, spec.describe())})"
    expects = f" (the file declares input {declared})" if declared else ""
    try:
        out = np.asarray(loaded(batch))
    except Exception as exc:  # the file's own program may raise anything on a wrong input
        raise InputDataError(
            f"{what}: a probe forward pass on input (2, 3, {side}, {side}) failed{expects}: "
            f"{type(exc).__name__}: {str(exc)[:300]}; the image spec's crop (--crop, or the sidecar's image) "
            "must be the input size the model takes"
        ) from exc
    if out.shape != (2, spec.num_classes):
        raise InputDataError(
            f"{what}: a probe forward pass on input (2, 3, {side}, {side}) returned scores of shape "
            f"{tuple(out.shape)}; expected (2, {spec.num_classes}): one score per class ({spec.num_classes} classes)"
        )
    if not np.isfinite(out).all():
        raise InputDataError(f"{what}: a probe forward pass on input (2, 3, {side}, {side}) gave non-finite scores")


def _stored_bytes(cfg: RegisterModelConfig, spec: ModelSpec, data: bytes, image: ImageSpec) -> bytes:
    """What the registry keeps: the checked tensors-only state dict, or the checked code-free file as given."""
    if spec.inference_only:
        loaded = load_file_model(spec.format, data, cfg.weights_uri)
        probe(loaded.logits, spec, image.crop, cfg.weights_uri, onnx_input_shape(loaded))
        return data
    state = strip_auxiliary_heads(spec, state_dict_from_bytes(data, cfg.weights_uri))
    if spec.factory is None:
        check_state_dict(spec, state, cfg.weights_uri)
    else:
        factory_models.check_on_cluster(spec, state_dict_bytes(state), image.crop, cfg.weights_uri)
    return state_dict_bytes(state)


def _with_code(cfg: RegisterModelConfig, spec: ModelSpec) -> ModelSpec:
    """The factory's ``--code`` zipped into the registry, its URI and hash on the spec."""
    if spec.factory is None or cfg.code is None:
        return spec
    code = factory_models.zip_code(cfg.code, spec.factory.top_level)
    uri, digest = factory_models.store_code(registry.model_root(cfg.name), code)
    version = factory_models.declared_version(cfg.code)
    factory = spec.factory.model_copy(update={"code_uri": uri, "code_sha256": digest, "package_version": version})
    return spec.model_copy(update={"factory": factory})


def run(cfg: RegisterModelConfig) -> RegisterModelResult:
    """Check the file against what the request says of it, then register it (or find the version it already
    is) and point the alias at it."""
    implied = _implied_format(cfg)
    data = storage.read_bytes(cfg.weights_uri)
    fmt = _format_of(cfg, data, implied)
    sidecar = read_sidecar(cfg.sidecar) if cfg.sidecar else None
    provisional = model_spec_for(cfg, fmt, 2)  # refuses contradictions before the classes are read
    named = sidecar.classes if sidecar and sidecar.classes is not None else cfg.classes
    classes = (
        _names_from(named, f"sidecar {cfg.sidecar}")
        if isinstance(named, list)
        else read_classes(named, provisional.arch)
    )
    spec = provisional.model_copy(update={"num_classes": len(classes)})
    image = image_spec_for(cfg, spec, sidecar)
    spec = _with_code(cfg, spec)
    samples = read_sample_images(cfg.samples, image) if cfg.samples else None
    stored = _stored_bytes(cfg, spec, data, image)
    # absolute, so lineage finds the file whatever folder it is read from
    source = WeightsSource(
        uri=storage.normalize(cfg.weights_uri), sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data)
    )
    version = _same_registration(cfg.name, spec, image, classes, source)
    reused = version is not None and (samples is None or version.samples_uri is not None)
    if version is None or not reused:  # new, or the same model given its sample images now: a version that has them
        version = registry.register(
            cfg.name,
            stored,
            model_spec=spec,
            image_spec=image,
            classes=classes,
            metrics={},
            code_version=cfg.code_version,
            flow_run_id=cfg.flow_run_id,
            weights_source=source,
            samples=samples,
        )
    move, note = _point_alias(cfg, version, source)
    return RegisterModelResult(version=version, reused=reused, alias_move=move, note=note)


def _implied_format(cfg: RegisterModelConfig) -> str | None:
    """The format ``--format`` or ``--arch``/``--factory`` (a state dict) say; what they and the sizes imply is
    checked before anything is read."""
    implied = cfg.format or ("state_dict" if cfg.arch or cfg.factory else None)
    if implied is not None:
        image_spec_for(cfg, model_spec_for(cfg, implied, 2))
    return implied


def _format_of(cfg: RegisterModelConfig, data: bytes, implied: str | None) -> str:
    """The file's format, read from its content; refused where the request said another."""
    fmt = detect_format(data, cfg.weights_uri)
    if implied is None or fmt == implied or (fmt not in FILE_FORMATS and implied not in FILE_FORMATS):
        return fmt
    said, fix = f"--format {cfg.format}", f"give --format {fmt} or none (it is read from the content)"
    if not cfg.format:
        said, fix = "--arch/--factory", "drop --arch/--factory, the file is the whole model"
    raise ConfigError(f"{cfg.weights_uri} is {described(fmt)}, but {said} says {described(implied)}: {fix}")


def _point_alias(
    cfg: RegisterModelConfig, version: registry.ModelVersion, source: WeightsSource
) -> tuple[registry.AliasMove | None, str | None]:
    """``--alias`` moved to the version (unless it is there already), and why it is another alias, if it is."""
    alias, note = cfg.alias, None
    expected: int | None | registry.Unchecked = registry.Unchecked.ANY  # an operator's --alias: wherever it is now
    if alias == registry.CHALLENGER and registry.alias_version(cfg.name, registry.CHAMPION) is None:
        # a challenger is canaried against the champion it serves next to: with none, it is the champion
        alias, note = registry.CHAMPION, f"{cfg.name} had no champion: v{version.version} is champion, not challenger"
        expected = None  # only while there still is none (AliasConflict if another run made one meanwhile)
    if not alias or registry.alias_version(cfg.name, alias) == version.version:
        return None, note
    return registry.set_alias(
        cfg.name, alias, version.version, f"registered from {source.uri}", expected=expected
    ), note


def read_sample_images(prefix_uri: str, image: ImageSpec) -> np.ndarray:
    """The first ``registry.MAX_SAMPLES`` images under ``prefix_uri`` (by key), decoded as the version will decode
    its inputs; a file that is not an image is refused by name, before anything is registered."""
    try:
        listed = storage.list_inputs(prefix_uri).objects[: registry.MAX_SAMPLES]
    except InputDataError as exc:
        raise ConfigError(f"--samples {prefix_uri}: {exc}") from exc
    if not listed:
        raise ConfigError(f"--samples {prefix_uri} holds no files: give a folder or prefix of the model's images")
    decoded = []
    for found in listed:
        try:
            decoded.append(decode_image(storage.read_bytes(found.uri), image))
        except ImageDecodeError as exc:
            raise ConfigError(f"--samples: {found.uri} is not an image the model can take ({exc})") from exc
    return np.stack(decoded)


def _same_registration(
    name: str, spec: ModelSpec, image: ImageSpec, classes: list[str], source: WeightsSource
) -> registry.ModelVersion | None:
    """The newest version registered from the same bytes as the same model, classes and image spec."""
    for version in reversed(registry.list_versions(name)):
        same_file = version.weights_source is not None and version.weights_source.sha256 == source.sha256
        if same_file and (version.model_spec, version.image_spec, version.classes) == (spec, image, classes):
            return version
    return None
