"""What a ``nightly-inference`` run is asked (:class:`NightRequest`), and what a range of nights answers.

Declared once, here: the fields' defaults, checks and help are the CLI's options, the flow's one parameter
(one form in Prefect's UI) and a deployment's parameters; the stage's ``InferenceConfig`` is a ``NightShape``.
A caller naming the fields otherwise (the CLI's ``--from``) passes its names as the validation context, so that
an error names what the user typed.
"""

from __future__ import annotations

import functools
import math
from datetime import date as Day
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rayline import storage
from rayline.errors import ConfigError
from rayline.models.request_fields import a_day, label, split_named_ref
from rayline.ray_workloads.execution.plan import PlanPolicy
from rayline.specs import DEFAULT_MODEL_NAME
from rayline.storage.layout import INCOMING_DIR, partition_for, yesterday_utc

# A year of nights (a leap year's included): longer ranges are more likely a typo than a backfill.
MAX_NIGHTS = 366
# Where a night's day goes in an input prefix given for a range (every night reads its own prefix).
DT_PLACEHOLDER = "{dt}"


class NightShape(BaseModel):
    """How one night runs on the cluster: its predictor actors, the CPUs each holds, the images per model call."""

    actors: int = Field(2, ge=1, description="Predictor actors (of each night).")
    batch_size: int = Field(
        64, ge=1, description="Images per model call, at most (capped by pixels: 32 at 224 px; model_batch_size)."
    )
    cpus_per_actor: float = Field(0.5, gt=0, description="Logical CPUs each predictor actor holds.")

    def nights_at_once(self, cluster_cpus: float, nights: int) -> int:
        """How many nights of a range run together by default: as many as the cluster's logical CPUs (when the run
        starts) hold all the actors of; more would only queue their actors. Between 1 and ``nights``."""
        per_night = self.actors * self.cpus_per_actor
        return max(1, min(nights, math.floor(cluster_cpus / per_night)))


class NightRequest(BaseModel):
    """One night (``date``, default yesterday, UTC) or an inclusive range of nights, each its own commit: a backfill
    after an outage or a new champion. Each night's rows replace its partition (model_name, dt) of the
    ``predictions`` and ``prediction_errors`` Delta tables."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    date: Day | None = Field(None, description="The night to predict, YYYY-MM-DD; default yesterday (UTC).")
    date_from: Day | None = Field(None, description="Backfill: the first night, YYYY-MM-DD (not with a date).")
    date_to: Day | None = Field(None, description="Backfill: the last night, YYYY-MM-DD (inclusive).")
    model: str = Field("champion", description="NAME@champion, NAME@v3, or an alias (champion) / version (v3).")
    model_name: str | None = Field(None, description=f"Registry name when model has no NAME@ ({DEFAULT_MODEL_NAME}).")
    input_uri: str | None = Field(
        None, description=f"Input prefix; default <storage>/{INCOMING_DIR}/dt=<day>. A range's has {DT_PLACEHOLDER}."
    )
    max_error_fraction: float = Field(
        0.05, ge=0, le=1, description="Each night's error budget: over it, it fails (committed)."
    )
    max_concurrent_nights: int | None = Field(
        None, ge=1, description="Backfill: nights at once; default the cluster's CPUs / one night's (actors × CPUs)."
    )
    plan: PlanPolicy = Field(default_factory=PlanPolicy, description="How each actor chooses its execution plan.")
    shadow: str | None = Field(
        None,
        description="Also score this version (v3, or an alias: challenger) on the same decoded images, into "
        "shadow_predictions, with its agreement with the night's model; RAYLINE_SHADOW_CHALLENGER=1 does it for "
        "the challenger whenever there is one.",
    )
    shape: NightShape = Field(default_factory=NightShape)

    _a_day = field_validator("date", "date_from", "date_to", mode="before")(a_day)

    @model_validator(mode="before")
    @classmethod
    def _split_a_named_model(cls, data: Any, info: ValidationInfo) -> Any:
        return split_named_ref(data, "model", info)

    @model_validator(mode="after")
    def _one_night_or_a_bounded_range(self, info: ValidationInfo) -> NightRequest:
        name, first, last = functools.partial(label, info), self.date_from, self.date_to
        if first is None and last is None:
            return self
        if self.date is not None:
            both = f"{name('date')} and {name('date_from')}/{name('date_to')}"
            raise ConfigError(f"{both} exclude each other: give one night or a range")
        if first is None or last is None:
            missing, given = ("date_from", "date_to") if first is None else ("date_to", "date_from")
            raise ConfigError(f"{name(given)} needs {name(missing)}: a range names both of its (inclusive) ends")
        if first > last:
            raise ConfigError(f"{name('date_from')} {first} is after {name('date_to')} {last}")
        if (count := (last - first).days + 1) > MAX_NIGHTS:
            raise ConfigError(
                f"{name('date_from')} {first} to {name('date_to')} {last} is {count} nights; at most {MAX_NIGHTS} "
                "at once: split the range"
            )
        if self.input_uri is not None and DT_PLACEHOLDER not in self.input_uri:
            raise ConfigError(
                f"{name('input_uri')} {self.input_uri!r} is one prefix for every night of the range: put "
                f"{DT_PLACEHOLDER} where the day goes (e.g. …/incoming-photos/dt={DT_PLACEHOLDER}), or leave it "
                f"out for <storage>/{INCOMING_DIR}/dt=<day>"
            )
        return self

    @property
    def is_range(self) -> bool:
        return self.date_from is not None

    def nights(self) -> list[Day]:
        """The nights in order: each of the range, else the one night (yesterday, UTC, unless ``date``)."""
        if self.date_from is None or self.date_to is None:
            return [self.date or yesterday_utc()]
        return [self.date_from + timedelta(days=n) for n in range((self.date_to - self.date_from).days + 1)]

    def input_for(self, day: Day, root: str) -> str:
        """Where a night's arrivals are: ``input_uri`` with ``{dt}`` filled in, else ``<root>/incoming/dt=<day>``."""
        if self.input_uri is None:
            return storage.join(root, INCOMING_DIR, partition_for(day))
        return self.input_uri.replace(DT_PLACEHOLDER, day.isoformat())


NightState = Literal["committed", "skipped", "failed"]


class NightOutcome(BaseModel):
    """One night of a range: committed, skipped (another run committed it meanwhile) or failed, and why."""

    dt: str
    state: NightState
    inputs: int | None = Field(None, description="None when the night failed before its inputs were counted.")
    predictions: int | None = None
    errors: int | None = None
    skipped_objects: dict[str, int] = Field(
        default_factory=dict, description="Listed objects that were no inputs (folder markers, …), by reason."
    )
    predictions_version: int | None = Field(None, description="The predictions table's version of the commit.")
    errors_version: int | None = Field(None, description="The prediction_errors table's version of the commit.")
    message: str = Field("", description="Why a night was skipped or failed (a night over budget is committed).")


class BackfillResult(BaseModel):
    """What a range run did, one outcome per night in date order."""

    model_name: str
    model: str = Field(description="The version every night used, resolved once when the run started.")
    date_from: str
    date_to: str
    max_concurrent_nights: int
    nights: list[NightOutcome]

    def in_state(self, state: NightState) -> list[NightOutcome]:
        return [night for night in self.nights if night.state == state]

    @property
    def failed(self) -> list[NightOutcome]:
        return self.in_state("failed")

    def failure_message(self) -> str:
        """One line naming each failed night and why."""
        reasons = "; ".join(f"{night.dt}: {night.message}" for night in self.failed)
        return f"{len(self.failed)} of {len(self.nights)} nights of {self.model_name} failed ({reasons})"
