"""rayline's Prefect tasks, each calling one stage over Ray, to compose in a flow of your own
(docs/api.md), with the configs they take and the results they return.

Each is imported on first use, not with this package: a task loads Prefect, Ray and its stage.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ingest_objects": "rayline.tasks.ingest",
    "IngestConfig": "rayline.ray_workloads.data.ingest",
    "IngestResult": "rayline.ray_workloads.data.ingest",
    "preprocess_images": "rayline.tasks.preprocess",
    "PreprocessConfig": "rayline.ray_workloads.data.preprocess",
    "PreprocessResult": "rayline.ray_workloads.data.preprocess",
    "batch_inference_task": "rayline.tasks.batch_inference",
    "InferenceConfig": "rayline.ray_workloads.nightly.contract",
    "InferenceResult": "rayline.ray_workloads.nightly.contract",
    "register_outside_model": "rayline.tasks.outside_models",
    "RegisterModelConfig": "rayline.ray_workloads.registration.outside_models",
    "resolve_version_task": "rayline.tasks.registry_lookups",
    "openlineage_flow": "rayline.tasks.flow_lineage",
    "vacuum_tables_task": "rayline.tasks.maintenance",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
