"""rayline's Prefect flows, to run as they are or as subflows of a flow of your own (docs/api.md).

Each is imported on first use, not with this package: a flow loads Prefect, Ray and the stages.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "prepare_data": "flows.prepare_data",
    "train_model": "flows.train_model",
    "register_model": "flows.register_model",
    "nightly_inference": "flows.nightly_inference",
    "serve_rollout": "flows.serve_rollout",
    "monitor": "flows.monitor",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'flows' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
