"""Prefect task: where a ``train-model`` run starts, read from the registry (``plan_training``).

A task, not flow code: the plan reads the registry (the parent, the
champion and its parent link) and a prepared-data manifest, which flows
reach only through tasks. :func:`plan_training` itself stays a plain
function, for callers outside a flow run.
"""

from __future__ import annotations

from pydantic import BaseModel

from rayline.errors import ConfigError, InferenceOnlyFormat
from rayline.models import registry
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.architectures.model_files import described
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.training.loop import InitFrom
from rayline.specs import ParentModel
from rayline.tasks.common import io_task

DEFAULT_MODEL = "digits"
FINE_TUNE_SUFFIX = "-ft"


class FineTunePlan(BaseModel):
    """Where a fine-tune starts: the parent version, how, and why (for the log)."""

    parent: ModelVersion
    freeze_backbone: bool
    why: str
    data_source: str | None = None  # retraining: the prefix the champion was fine-tuned on

    def parent_link(self) -> ParentModel:
        return ParentModel(
            name=self.parent.name,
            version=self.parent.version,
            uri=self.parent.uri,
            freeze_backbone=self.freeze_backbone,
        )

    def init(self) -> InitFrom:
        return InitFrom(
            weights_uri=self.parent.weights_uri,
            model=self.parent.model_spec,
            freeze_backbone=self.freeze_backbone,
        )


def refuse_inference_only(parent: ModelVersion) -> None:
    """A code-free file cannot be fine-tuned: said before any cluster time, naming the format."""
    if parent.model_spec.inference_only:
        raise InferenceOnlyFormat(
            f"{parent.name} v{parent.version} is {described(parent.model_spec.format)}, an inference-only "
            "format: rayline runs it in nights and behind /predict, but cannot rebuild its module to fine-tune it. "
            "Register its weights as a state dict (--arch <torchvision name or timm:<name>>, or --factory) to "
            "fine-tune it"
        )


def plan_training(
    model_name: str | None, init_from: str | None, freeze_backbone: bool | None
) -> tuple[str, FineTunePlan | None]:
    """The registry name to train and, for a fine-tune, where it starts.

    * ``init_from`` (``NAME@champion``, ``NAME@v3``): fine-tune that version;
      the result is ``model_name`` or ``<parent>-ft``.
    * otherwise, a model whose champion was fine-tuned from a parent (an
      outside model, say) is retrained the same way: from the same parent
      version, frozen or not as before unless ``freeze_backbone`` says. This is
      what makes the event-triggered ``retrain`` deployment fine-tune such a
      model instead of training its architecture from scratch.
    * otherwise: plain training of ``model_name`` (default ``digits``).
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
    refuse_inference_only(registry.get_version(link.name, link.version))
    frozen = link.freeze_backbone if freeze_backbone is None else freeze_backbone
    assert champion is not None  # a parent link comes from a champion
    return name, FineTunePlan(
        parent=registry.get_version(link.name, link.version),
        freeze_backbone=frozen,
        why=f"champion {name} v{number} was fine-tuned from {link.name} v{link.version}",
        data_source=preprocess.source_of(champion.data_manifest_uri) if champion.data_manifest_uri else None,
    )


@io_task("plan-training")
def plan_training_task(
    model_name: str | None, init_from: str | None, freeze_backbone: bool | None
) -> tuple[str, FineTunePlan | None]:
    """:func:`plan_training`, in a flow run: its registry and manifest reads get the retry policy."""
    return plan_training(model_name, init_from, freeze_backbone)
