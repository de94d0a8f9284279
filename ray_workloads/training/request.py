"""What a train-model run is asked: one typed request, the same from the command line, the flow's form and
the deployments, checked here alone. Plain pydantic without torch or Prefect: the command line builds its
options from the fields. The stage configs inherit the groups they share with it (:class:`Hyperparameters`,
:class:`TrainShape`, :class:`GateOptions`): each default is written once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rayline.errors import ConfigError
from rayline.models.refs import parse_named_ref
from rayline.specs import DIGITS_IMAGE_SIZE, GATE_ALPHA, check_model_name


class Hyperparameters(BaseModel):
    """What a training run learns with; Tune searches the lr, weight decay and batch size from them."""

    epochs: int = Field(12, ge=1, description="Training epochs.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (cosine decay over the epochs).")
    batch_size: int = Field(32, ge=1, description="Images per batch, per worker.")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW's weight decay.")


class TrainShape(BaseModel):
    """The compute of a training run: Ray Train's workers and the CPUs each asks for."""

    num_workers: int = Field(2, ge=1, description="Ray Train workers.")
    cpus_per_worker: float = Field(0.5, gt=0, description="Logical CPUs per worker (a fraction leaves Ray Data room).")


class GateOptions(BaseModel):
    """What a trained candidate must show to be promoted (:func:`rayline.models.registry.gate`)."""

    margin: float = Field(0.0, description="Accuracy a candidate must gain over the champion.")
    floor: float = Field(0.9, description="Accuracy the first champion needs.")
    alpha: float = Field(
        GATE_ALPHA,
        gt=0,
        lt=0.5,
        description="The most often a candidate no better than the champion passes the gate (exact McNemar test "
        "on the test images where exactly one of them is right).",
    )
    promote_to: Literal["champion", "challenger"] = Field(
        "champion", description="Alias a model that passes the gate gets: champion, or challenger for a rollout."
    )


class TrainTarget(BaseModel):
    """What a run trains, on what data, from where it starts, and whether it searches first."""

    model_name: str | None = Field(None, description="Registry name; default digits, or <parent>-ft with init_from.")
    source_uri: str | None = Field(None, description="Prefix of labelled images; default <storage>/raw.")
    arch: str | None = Field(
        None, description="small_cnn (default) or any torchvision classifier (resnet18, …); not with init_from."
    )
    width: int = Field(32, ge=4, le=512, description="Base channel count of small_cnn.")
    init_from: str | None = Field(
        None,
        description="Fine-tune a registered model (NAME@champion, NAME@v3): its weights, a new head for the data's "
        "classes, its image preprocessing; no search.",
    )
    freeze_backbone: bool | None = Field(
        None, description="Fine-tuning: train only the new head (default: as the champion's fine-tune did, else all)."
    )
    labelled: bool = Field(
        False, description="Train on the model's labelled photos (rayline labels import), fine-tuning its champion."
    )
    tune_samples: int = Field(0, ge=0, description="ASHA trials first (0: no search).")
    tune_max_epochs: int = Field(4, ge=1, description="Epochs of the longest trial.")
    require_labelled_win: bool | None = Field(
        None,
        description="The champion moves only when the labels say the model beats it; until they decide it is "
        "challenger (default RAYLINE_REQUIRE_LABELLED_WIN).",
    )

    @field_validator("model_name")
    @classmethod
    def _a_registry_name(cls, name: str | None) -> str | None:
        return None if name is None else check_model_name(name.strip())

    @field_validator("init_from")
    @classmethod
    def _a_named_version(cls, ref: str | None) -> str | None:
        if ref is not None:
            parse_named_ref(ref)  # a malformed reference fails here, naming itself
        return ref

    @model_validator(mode="after")
    def _what_a_start_can_honour(self) -> TrainTarget:
        if self.labelled and (self.source_uri is not None or self.init_from is not None):
            raise ConfigError(
                "labelled trains the model's champion on its labelled photos: give no source_uri or init_from"
            )
        if self.init_from is not None and self.arch is not None:
            raise ConfigError(f"arch {self.arch}: a fine-tune keeps the architecture of init_from {self.init_from}")
        if self.init_from is not None and self.tune_samples > 0:
            raise ConfigError(
                f"tune_samples {self.tune_samples}: fine-tuning runs no search (each trial would be a whole "
                "fine-tune); drop it"
            )
        if self.arch is not None:
            from rayline.ray_workloads.architectures.build import check_input_size  # torch: only when asked

            # an unknown name, or one that cannot take the squares prepare_data makes, fails before any cluster time
            check_input_size(self.arch, DIGITS_IMAGE_SIZE)
        return self


# the groups in reverse: pydantic lists the last base's fields first, so --help starts with what is trained
class TrainRequest(GateOptions, TrainShape, Hyperparameters, TrainTarget):
    """One train-model run: what to train (a fine-tune, a search), its hyper-parameters, compute and gate."""

    model_config = ConfigDict(frozen=True)
