"""rayline's Prefect events by name: what stages announce, for automations (retraining, rollouts) and for people.

The names live in core because both ends use them: the tasks and flows that emit them
(``rayline.tasks.common.emit``) and the deployments whose triggers wait for them (``deployments/catalog.py``).

Prefect triggers match resource *labels* (strings, globs), not numbers, so an event that an automation must
threshold carries the decision as a label: ``rayline.data.arrived`` has ``rayline.retrain = "true"`` when its
new labelled objects reach ``RAYLINE_RETRAIN_MIN_NEW_LABELLED``, and ``rayline.labels.arrived`` when the labels
imported since the model last trained on its labels reach ``RAYLINE_RETRAIN_MIN_NEW_LABELS``.
"""

from __future__ import annotations

DATA_ARRIVED = "rayline.data.arrived"
# a labels import added labels for a model's predicted photos: labelled with the model and the retrain decision
LABELS_ARRIVED = "rayline.labels.arrived"
DRIFT_DETECTED = "rayline.drift.detected"
HEALTH_DEGRADED = "rayline.serve.unhealthy"
# the version with the most traffic is not the registry's champion, and no rollout holds the model's lease
CHAMPION_NOT_SERVED = "rayline.serve.champion_mismatch"
# an alias moved (champion or challenger), whoever moved it: labelled with the model and the alias
ALIAS_MOVED = "rayline.model.alias_moved"
ROLLED_BACK = "rayline.rollout.rolled_back"
PROMOTED = "rayline.rollout.promoted"
RETRAIN_LABEL = "rayline.retrain"


def model_resource(name: str, version: int) -> str:
    return f"rayline.model.{name}.v{version}"
