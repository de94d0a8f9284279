"""Which nights a ``nightly-inference`` run covers, how many run at once, and what became of each.

One night (``date``, default yesterday) or an inclusive range
(``date_from``..``date_to``): a backfill after an outage or a new champion.
Each night of a range is its own run and its own Delta commit; a night that
fails leaves the others alone. Prefect-free and Ray-free, so the CLI checks
its options with the same rules as the flow before anything starts.
"""

from __future__ import annotations

import math
from datetime import date, timedelta
from typing import Literal, NamedTuple

from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import ConfigError
from rayline.storage.layout import INCOMING_DIR, parse_day, partition_for

# A year of nights (a leap year's included): longer ranges are more likely a typo than a backfill.
MAX_NIGHTS = 366
# Where a night's day goes in an input prefix given for a range (every night reads its own prefix).
DT_PLACEHOLDER = "{dt}"


class RangeLabels(NamedTuple):
    """What the caller calls the three options, so that an error names the one the user typed."""

    date: str = "date"
    start: str = "date_from"
    end: str = "date_to"
    input_uri: str = "input_uri"


FLOW_LABELS = RangeLabels()


def night_range(
    day: str | None, date_from: str | None, date_to: str | None, labels: RangeLabels = FLOW_LABELS
) -> list[date] | None:
    """The nights of ``date_from``..``date_to`` (inclusive) in order; None when no range was asked for.

    A range needs both ends and excludes ``day``; it is refused when it runs
    backwards or spans more than :data:`MAX_NIGHTS` nights.
    """
    if date_from is None and date_to is None:
        return None
    if day is not None:
        raise ConfigError(
            f"{labels.date} and {labels.start}/{labels.end} exclude each other: give one night or a range"
        )
    if date_from is None or date_to is None:
        missing, given = (labels.start, labels.end) if date_from is None else (labels.end, labels.start)
        raise ConfigError(f"{given} needs {missing}: a range names both of its (inclusive) ends")
    first, last = parse_day(date_from, labels.start), parse_day(date_to, labels.end)
    if first > last:
        raise ConfigError(f"{labels.start} {first} is after {labels.end} {last}")
    count = (last - first).days + 1
    if count > MAX_NIGHTS:
        raise ConfigError(
            f"{labels.start} {first} to {labels.end} {last} is {count} nights; at most {MAX_NIGHTS} at once: "
            "split the range"
        )
    return [first + timedelta(days=offset) for offset in range(count)]


def check_range_input(input_uri: str | None, labels: RangeLabels = FLOW_LABELS) -> None:
    """A range's input prefix must say where each night's day goes, or every night would read the same objects."""
    if input_uri is not None and DT_PLACEHOLDER not in input_uri:
        raise ConfigError(
            f"{labels.input_uri} {input_uri!r} is one prefix for every night of the range: put {DT_PLACEHOLDER} "
            f"where the day goes (e.g. …/incoming-photos/dt={DT_PLACEHOLDER}), or leave it out for "
            f"<storage>/{INCOMING_DIR}/dt=<day>"
        )


def night_input_uri(input_uri: str | None, root: str, day: date) -> str:
    """Where a night's arrivals are: ``input_uri`` with ``{dt}`` filled in, else ``<root>/incoming/dt=<day>``."""
    if input_uri is None:
        return storage.join(root, INCOMING_DIR, partition_for(day))
    return input_uri.replace(DT_PLACEHOLDER, day.isoformat())


def nights_at_once(cluster_cpus: float, actors: int, cpus_per_actor: float, nights: int) -> int:
    """How many nights run together by default: as many as the cluster has CPUs for all their actors.

    A night asks for ``actors`` × ``cpus_per_actor`` CPUs; more nights than
    that would only queue their actors behind each other's. Between 1 and
    ``nights``. The cluster's CPUs are its logical CPUs as Ray reports them
    when the run starts (an autoscaling cluster's current size).
    """
    per_night = actors * cpus_per_actor
    fits = math.floor(cluster_cpus / per_night) if per_night > 0 else nights
    return max(1, min(nights, fits))


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


def failure_message(result: BackfillResult) -> str:
    """One line naming each failed night and why."""
    failed = result.failed
    reasons = "; ".join(f"{night.dt}: {night.message}" for night in failed)
    return f"{len(failed)} of {len(result.nights)} nights of {result.model_name} failed ({reasons})"
