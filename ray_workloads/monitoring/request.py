"""What a ``monitor`` run is asked (:class:`MonitorRequest`): declared once, for the CLI's options, the flow's
one parameter and the scheduled deployment's, as ``rayline.ray_workloads.nightly.request`` explains."""

from __future__ import annotations

from datetime import date

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rayline.models.request_fields import a_day
from rayline.ray_workloads.monitoring.thresholds import DriftThresholds
from rayline.specs import DEFAULT_MODEL_NAME, check_model_name
from rayline.tables.prediction_reads import DEFAULT_RETENTION_HOURS, check_retention


class MonitorRequest(BaseModel):
    """Judge serving health and a model's latest committed nights for drift, then vacuum the night tables."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str = Field(DEFAULT_MODEL_NAME, description="Registry name whose nights to judge.")
    partitions: int = Field(1, ge=1, description="Latest committed nights to judge.")
    check_serving: bool = Field(True, description="Also check the serving router.")
    reference_date: date | None = Field(
        None, description="Night (YYYY-MM-DD) to compare with; default the training labels, else the first night."
    )
    thresholds: DriftThresholds = Field(default_factory=DriftThresholds)
    vacuum_retention_hours: int | None = Field(
        DEFAULT_RETENTION_HOURS,
        description="Vacuum both night tables keeping this many hours of time travel (none: no vacuum).",
    )
    quality_nights: int = Field(14, ge=1, description="Latest labelled nights each version's quality covers.")

    _a_day = field_validator("reference_date", mode="before")(a_day)
    _a_name = field_validator("model_name")(check_model_name)

    @field_validator("vacuum_retention_hours")
    @classmethod
    def _safe_retention(cls, hours: int | None) -> int | None:
        if hours is not None:
            check_retention(hours)
        return hours
