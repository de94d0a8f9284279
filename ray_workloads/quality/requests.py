"""What the labels flows are asked (:class:`LabelsImportRequest`, :class:`LabelQueueRequest`): declared once, for
the CLI's options and the flows' one parameter, as ``rayline.ray_workloads.nightly.request`` explains."""

from __future__ import annotations

from datetime import date
from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rayline.models.request_fields import a_day
from rayline.specs import DEFAULT_MODEL_NAME, check_model_name

if TYPE_CHECKING:  # the stages load pyarrow.compute and deltalake, which the CLI's start does without
    from rayline.ray_workloads.quality.labels_import import LabelsImportConfig
    from rayline.ray_workloads.quality.queue import QueueConfig


class Selection(StrEnum):
    """How the labelled photos were chosen (an enum: the command line takes no Literal)."""

    random = "random"


class LabelsImportRequest(BaseModel):
    """Import a labels file: columns uri (or key) and label (a class name or index), optionally etag, source,
    labelled_at."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = Field(description="CSV, Parquet or JSON Lines (.csv, .parquet, .jsonl): path or URI.")
    model_name: str = Field(DEFAULT_MODEL_NAME, description="The registered model the labels are for.")
    key_base: str | None = Field(None, description="What a 'key' column is relative to; default <storage>/incoming.")
    source: str | None = Field(None, description="Who labelled, for rows without a 'source' column.")
    selection: Selection | None = Field(
        None,
        description="random: the file's photos were chosen uniformly at random, whatever the models answered, so "
        "its labels may judge a challenger (a queue's random draw needs no saying; docs/quality.md).",
    )

    _a_name = field_validator("model_name")(check_model_name)

    def config(self, root: str, classes: list[str], incoming: str) -> LabelsImportConfig:
        """The stage's config: keys relative to ``incoming`` unless the request says otherwise."""
        from rayline.ray_workloads.quality.labels_import import LabelsImportConfig

        return LabelsImportConfig(
            file_uri=self.file,
            root=root,
            model_name=self.model_name,
            classes=classes,
            key_base=self.key_base or incoming,
            source=self.source,
            selection=None if self.selection is None else self.selection.value,
        )


class LabelQueueRequest(BaseModel):
    """Queue a night's photos to label: a share drawn at random, the rest those most worth labelling."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    night: date = Field(description="The night to choose from, YYYY-MM-DD.")
    budget: int = Field(100, ge=1, description="Photos to queue, at most.")
    model_name: str = Field(DEFAULT_MODEL_NAME, description="The registered model whose night it is.")
    random_share: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="Share of the budget drawn at random from the night: the only labels that may judge a challenger.",
    )

    _a_day = field_validator("night", mode="before")(a_day)
    _a_name = field_validator("model_name")(check_model_name)

    def config(self, root: str, reference_counts: dict[str, int]) -> QueueConfig:
        from rayline.ray_workloads.quality.queue import QueueConfig

        return QueueConfig(
            root=root,
            model_name=self.model_name,
            dt=self.night.isoformat(),
            budget=self.budget,
            reference_counts=reference_counts,
            random_share=self.random_share,
        )
