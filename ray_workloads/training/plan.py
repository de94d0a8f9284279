"""Where a train-model run starts and what it runs: :func:`plan_training` turns a :class:`TrainRequest` and the
registry into a :class:`TrainingPlan`, which makes each step's config; the flow only composes the steps. It
reads the registry and a manifest, so a flow run makes it in a task (``rayline.tasks.training_plan``).
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel

from rayline.config import labelled_win_required
from rayline.errors import ConfigError, InferenceOnlyFormat
from rayline.models import registry
from rayline.models.registry import CHAMPION, ModelVersion, TrainingLabels
from rayline.ray_workloads.architectures.build import ModelSpec
from rayline.ray_workloads.architectures.model_files import described
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.quality.training_set import ExportConfig, ExportResult
from rayline.ray_workloads.training.evaluate import EvaluationResult
from rayline.ray_workloads.training.loop import InitFrom, TrainLoopConfig
from rayline.ray_workloads.training.promotion import PromotionConfig
from rayline.ray_workloads.training.request import GateOptions, Hyperparameters, TrainRequest, TrainShape
from rayline.ray_workloads.training.train import TrainConfig, TrainResult
from rayline.ray_workloads.training.tune import TuneJobConfig, TuneResult
from rayline.specs import DIGITS_IMAGE_SIZE, SMALL_CNN, ImageSpec, ParentModel, squash
from rayline.storage.layout import (
    RAW_DIR,
    TRAINING_DIR,
    TUNING_DIR,
    check_input_apart_from_checkpoints,
    checkpoints_uri,
    root_uri,
    under_root,
)

DEFAULT_MODEL = "digits"
FINE_TUNE_SUFFIX = "-ft"


class FineTunePlan(BaseModel):
    """Where a fine-tune starts: the parent version, how, and why (for the log)."""

    parent: ModelVersion
    freeze_backbone: bool
    why: str
    data_source: str | None = None  # retraining: the prefix the champion was fine-tuned on

    def parent_link(self) -> ParentModel:
        parent, frozen = self.parent, self.freeze_backbone
        return ParentModel(name=parent.name, version=parent.version, uri=parent.uri, freeze_backbone=frozen)

    def init(self) -> InitFrom:
        parent, frozen = self.parent, self.freeze_backbone
        return InitFrom(weights_uri=parent.weights_uri, model=parent.model_spec, freeze_backbone=frozen)


def run_name(model_name: str, data_hash: str, loop: TrainLoopConfig) -> str:
    """Same data and hyper-parameters → same run name → a rerun resumes its checkpoints."""
    # plain training leaves ``init`` out, so its run names (and resumable checkpoints) are those of before fine-tuning
    fields = loop.model_dump(mode="json", exclude={"init"} if loop.init is None else None)
    params = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return f"{model_name}-{data_hash[:10]}-{params[:8]}"


class TrainingPlan(BaseModel):
    """Everything a train-model run decides before it starts; its methods make each step's config."""

    request: TrainRequest
    name: str
    source_uri: str
    image: ImageSpec
    loop: TrainLoopConfig  # before any search
    fine_tune: FineTunePlan | None = None
    trained_on_labels: TrainingLabels | None = None
    labelled_root: str | None = None  # the champion moves only on a labelled win

    @property
    def searches(self) -> bool:
        return self.request.tune_samples > 0 and self.fine_tune is None

    @property
    def note(self) -> str | None:
        """For the run's log, the search asked for and not run: each ASHA trial would be a whole fine-tune of a
        torchvision model at the parent's resolution (224 px for ImageNet weights), too much for a small cluster."""
        if self.fine_tune is None or not self.request.tune_samples:
            return None
        parent, asked = self.fine_tune.parent, self.request.tune_samples
        return (
            f"fine-tuning {self.name} from {parent.name} v{parent.version} ({self.fine_tune.why}): "
            f"no hyper-parameter search, tune_samples={asked} ignored"
        )

    def search(self, data: preprocess.PreprocessResult) -> TuneJobConfig:
        samples = self.request.tune_samples
        return TuneJobConfig(
            data_manifest_uri=data.manifest_uri,
            output_root=checkpoints_uri(TUNING_DIR),
            experiment_name=run_name(f"{self.name}-tune{samples}", data.input_content_hash, self.loop),
            num_samples=samples,
            max_epochs=self.request.tune_max_epochs,
            tracking_experiment=self.name,
        )

    def training(self, data: preprocess.PreprocessResult, searched: TuneResult | None) -> TrainConfig:
        """The Train run: the loop with the search's best merged in, named by the data and that loop."""
        loop = searched.tuned(self.loop) if searched is not None else self.loop
        return TrainConfig(
            data_manifest_uri=data.manifest_uri,
            output_root=checkpoints_uri(TRAINING_DIR),
            run_name=run_name(self.name, data.input_content_hash, loop),
            loop=loop,
            **_fields_of(TrainShape, self.request),
        )

    def promotion(self, training: TrainConfig, trained: TrainResult, evaluation: EvaluationResult) -> PromotionConfig:
        return PromotionConfig(
            name=self.name,
            spec=training.loop.model,
            trained=trained,
            evaluation=evaluation,
            parent=self.fine_tune.parent_link() if self.fine_tune else None,
            labelled_root=self.labelled_root,
            trained_on_labels=self.trained_on_labels,
            **_fields_of(GateOptions, self.request),
        )


def _fields_of(group: type[BaseModel], request: TrainRequest) -> dict[str, object]:
    """The request's values of one of its field groups, to hand to a stage config of the same group."""
    return {name: getattr(request, name) for name in group.model_fields}


def labelled_export(request: TrainRequest) -> ExportConfig:
    """What a training on the labels exports: the model's labelled photos, covering its champion's classes."""
    name = request.model_name or DEFAULT_MODEL
    champion = registry.alias_version(name, CHAMPION)
    classes = registry.resolve(name, champion).classes if champion is not None else []
    return ExportConfig(root=root_uri(), model_name=name, classes=classes)


def plan_training(request: TrainRequest, exported: ExportResult | None = None) -> TrainingPlan:
    """The plan of ``request``: the registry name, the fine-tune (if any), the source, the image spec and the loop.
    ``exported``: the labelled photos its champion is fine-tuned on (``request.labelled``; anew with none)."""
    name, init_from = request.model_name, request.init_from
    if exported is not None:
        name = exported.model_name
        init_from = f"{name}@{CHAMPION}" if registry.alias_version(name, CHAMPION) is not None else None
    name, fine_tune = fine_tune_plan(name, init_from, request.freeze_backbone)
    source = _source(request, fine_tune, exported)
    # before any work: checkpoints apart from every input (Tune unpickles what it finds there)
    check_input_apart_from_checkpoints(source, "source_uri")
    model = fine_tune.parent.model_spec if fine_tune else ModelSpec(arch=request.arch or SMALL_CNN, width=request.width)
    init = fine_tune.init() if fine_tune else None
    labels = (
        TrainingLabels(labels_version=exported.labels_version, import_ids=exported.import_ids) if exported else None
    )
    return TrainingPlan(
        request=request,
        name=name,
        source_uri=source,
        image=fine_tune.parent.image_spec if fine_tune else squash(DIGITS_IMAGE_SIZE),
        loop=TrainLoopConfig(model=model, init=init, **_fields_of(Hyperparameters, request)),
        fine_tune=fine_tune,
        trained_on_labels=labels,
        labelled_root=root_uri() if labelled_win_required(request.require_labelled_win) else None,
    )


def _source(request: TrainRequest, fine_tune: FineTunePlan | None, exported: ExportResult | None) -> str:
    """The labels exported; else the prefix asked; else a retrained fine-tune's own prefix; else ``<storage>/raw``."""
    if exported is not None:
        return exported.folder
    return request.source_uri or (fine_tune.data_source if fine_tune else None) or under_root(RAW_DIR)


def refuse_inference_only(parent: ModelVersion) -> None:
    """A code-free file cannot be fine-tuned: said before any cluster time, naming the format."""
    if parent.model_spec.inference_only:
        raise InferenceOnlyFormat(
            f"{parent.name} v{parent.version} is {described(parent.model_spec.format)}, an inference-only "
            "format: rayline runs it in nights and behind /predict, but cannot rebuild its module to fine-tune it. "
            "Register its weights as a state dict (--arch <torchvision name or timm:<name>>, or --factory) to "
            "fine-tune it"
        )


def fine_tune_plan(
    model_name: str | None, init_from: str | None, freeze_backbone: bool | None
) -> tuple[str, FineTunePlan | None]:
    """The registry name to train and, for a fine-tune, where it starts.

    * ``init_from`` (``NAME@champion``, ``NAME@v3``): fine-tune that version, as ``model_name`` or ``<parent>-ft``;
    * else a model whose champion was fine-tuned from a parent is retrained the same way (frozen or not as
      before unless ``freeze_backbone`` says): the ``retrain`` deployment never trains such a model from scratch;
    * else plain training of ``model_name`` (default ``digits``).
    """
    if init_from is not None:
        parent_name, ref = registry.parse_named_ref(init_from)
        parent = registry.resolve(parent_name, ref)
        refuse_inference_only(parent)
        return model_name or f"{parent.name}{FINE_TUNE_SUFFIX}", FineTunePlan(
            parent=parent, freeze_backbone=bool(freeze_backbone), why=f"init_from={init_from}"
        )
    name = model_name or DEFAULT_MODEL
    number = registry.alias_version(name, registry.CHAMPION)
    champion = registry.get_version(name, number) if number is not None else None
    link = champion.parent if champion is not None else None
    if champion is not None and link is None and champion.weights_source is not None:
        raise ConfigError(
            f"{name} v{champion.version} is an outside model (registered from {champion.weights_source.uri}), "
            f"not trained here: fine-tune it with init_from={name}@champion (--init-from) and a labelled source"
        )
    if link is None:
        if freeze_backbone:
            raise ConfigError(
                f"freeze_backbone applies to fine-tuning only: give init_from (NAME@champion); "
                f"{name} has no fine-tuned champion to retrain from its parent"
            )
        return name, None
    parent = registry.get_version(link.name, link.version)
    refuse_inference_only(parent)
    assert champion is not None  # a parent link comes from a champion
    return name, FineTunePlan(
        parent=parent,
        freeze_backbone=link.freeze_backbone if freeze_backbone is None else freeze_backbone,
        why=f"champion {name} v{number} was fine-tuned from {link.name} v{link.version}",
        data_source=preprocess.source_of(champion.data_manifest_uri) if champion.data_manifest_uri else None,
    )
