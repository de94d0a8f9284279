"""Names of the storage layout, in one place: every stage and reader agrees on where things live.

``<storage>/raw`` (labelled training images), ``incoming/dt=<day>`` (a day
of arrivals), the Delta tables ``predictions`` and ``prediction_errors``
(partitioned by ``model_name`` and ``dt``: two models' nights of one day
never collide), ``monitoring/<model>.prom``.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from rayline import storage
from rayline.errors import InputDataError
from rayline.specs import check_model_name

RAW_DIR = "raw"
INCOMING_DIR = "incoming"
PREDICTIONS_TABLE = "predictions"
ERRORS_TABLE = "prediction_errors"
MONITORING_DIR = "monitoring"
# Runs' scratch space (a night's listing parts, its lease): hidden from listings of the root.
STAGING_DIR = "_staging"


def root_uri() -> str:
    """The configured storage root, normalized: where every name here lives (from settings; reads no storage)."""
    return storage.storage_root()


def under_root(*parts: str) -> str:
    """``<storage root>/<parts>``: e.g. ``under_root(RAW_DIR)``, the labelled training images."""
    return storage.join(storage.storage_root(), *parts)


def metrics_uri(root: str, model: str) -> str:
    """``<root>/monitoring/<model>.prom``: one file per model in one flat folder, what node-exporter's
    textfile collector reads (``*.prom``)."""
    return storage.join(root, MONITORING_DIR, f"{model}.prom")


def staging_uri(root: str, *parts: str) -> str:
    """``<root>/_staging/<parts>``: e.g. ``staging_uri(root, "nights", model, "dt=…", "listing")``."""
    return storage.join(storage.normalize(root), STAGING_DIR, *parts)


def partition_for(day: date) -> str:
    return f"dt={day.isoformat()}"


def table_uri(root: str, name: str) -> str:
    """``<root>/<name>``: where a night table lives (``PREDICTIONS_TABLE`` or ``ERRORS_TABLE``)."""
    return storage.join(storage.normalize(root), name)


def model_name(text: str) -> str:
    """A registered model's name as a partition value: checked like any registry name."""
    return check_model_name(text.strip())


def parse_day(text: str, what: str = "date") -> date:
    try:
        return datetime.strptime(text, "%Y-%m-%d").date()
    except ValueError as exc:
        raise InputDataError(f"{what} must look like 2026-11-28, got {text!r}") from exc


def yesterday_utc() -> date:
    return (datetime.now(UTC) - timedelta(days=1)).date()
