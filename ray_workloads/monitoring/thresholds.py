"""When a night or a serving version counts as unhealthy (:class:`DriftThresholds`): a pydantic model alone,
so the monitor's request and the CLI read it without ``monitor``, which loads Ray Data and pandas."""

from __future__ import annotations

from pydantic import BaseModel, Field


class DriftThresholds(BaseModel):
    psi: float = Field(0.2, gt=0, description="Class PSI against the reference above which a night drifted.")
    low_confidence: float = Field(0.5, gt=0, lt=1, description="A prediction under this confidence is unsure.")
    max_low_confidence_share: float = Field(0.3, ge=0, le=1, description="Share of unsure predictions a night allows.")
    max_error_fraction: float = Field(0.05, ge=0, le=1, description="Share of unreadable inputs a night allows.")
    max_serving_error_rate: float = Field(0.01, ge=0, le=1, description="5xx share a serving version allows.")
