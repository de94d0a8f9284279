"""rayline's Prefect events: what stages announce, for automations (retraining, rollouts) and for people.

Prefect triggers match resource *labels* (strings, globs), not numbers, so
an event that an automation must threshold carries the decision as a label:
``rayline.data.arrived`` has ``rayline.retrain = "true"`` when its new
labelled objects reach ``RAYLINE_RETRAIN_MIN_NEW_LABELLED``.
"""

from __future__ import annotations

import uuid
from typing import Any

from prefect.events import emit_event

from ray_workloads.ingest import Arrivals
from rayline.config import get_settings

DATA_ARRIVED = "rayline.data.arrived"
DRIFT_DETECTED = "rayline.drift.detected"
HEALTH_DEGRADED = "rayline.serve.unhealthy"
CHALLENGER_REGISTERED = "rayline.model.challenger"
ROLLED_BACK = "rayline.rollout.rolled_back"
PROMOTED = "rayline.rollout.promoted"
RETRAIN_LABEL = "rayline.retrain"


def emit(
    event: str,
    resource_id: str,
    payload: dict[str, Any],
    labels: dict[str, str] | None = None,
    idempotency_key: str | None = None,
) -> None:
    """Emit ``event``; with ``idempotency_key`` its id is derived from the key, so an event a
    retried task emits again is the same event: Prefect's server stores it and fires its
    triggers once."""
    event_id = uuid.uuid5(uuid.NAMESPACE_URL, f"rayline:{event}:{idempotency_key}") if idempotency_key else None
    emit_event(
        event=event, resource={"prefect.resource.id": resource_id, **(labels or {})}, payload=payload, id=event_id
    )


def model_resource(name: str, version: int) -> str:
    return f"rayline.model.{name}.v{version}"


def data_arrived(arrivals: Arrivals, may_retrain: bool = True, idempotency_key: str | None = None) -> bool:
    """Announce new objects under a prefix; True when they are enough to retrain on.

    ``may_retrain`` False: announced, but never labelled for retraining (the caller trains on them).
    """
    eligible = may_retrain and arrivals.new_labelled >= get_settings().retrain_min_new_labelled
    emit(
        DATA_ARRIVED,
        f"rayline.data.{arrivals.source_uri}",
        payload=arrivals.model_dump(),
        labels={RETRAIN_LABEL: "true" if eligible else "false", "rayline.prefix": arrivals.source_uri},
        idempotency_key=idempotency_key,
    )
    return eligible
