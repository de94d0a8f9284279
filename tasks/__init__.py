"""rayline's Prefect tasks, each calling one stage over Ray, to compose in a flow of your own
(docs/api.md), with the configs they take and the results they return.

Each is imported on first use, not with this package: a task loads Prefect, Ray and its stage.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ingest_objects": "tasks.ingest",
    "IngestConfig": "ray_workloads.data.ingest",
    "IngestResult": "ray_workloads.data.ingest",
    "preprocess_images": "tasks.preprocess",
    "PreprocessConfig": "ray_workloads.data.preprocess",
    "PreprocessResult": "ray_workloads.data.preprocess",
    "batch_inference_task": "tasks.batch_inference",
    "InferenceConfig": "ray_workloads.nightly.contract",
    "InferenceResult": "ray_workloads.nightly.contract",
    "register_outside_model": "tasks.outside_models",
    "RegisterModelConfig": "ray_workloads.registration.outside_models",
    "resolve_version_task": "tasks.registry_lookups",
    "vacuum_tables_task": "tasks.maintenance",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tasks' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
