"""The rayline side of a batch-inference measurement, up to the run: connect, wait for quiet, the night's config.

Shared by the digits (bench/batch_inference.py) and the photos (bench/resnet_inference.py).
"""

from __future__ import annotations

import time
from typing import Any

DAY = "2026-11-28"


def connect_for_night(spec: dict[str, Any], version: Any, **settings: Any) -> tuple[Any, float, float]:
    """Connect as tasks/batch_inference.py does and wait until the machine is idle; returns the night's
    ``InferenceConfig`` (``settings`` on top), the seconds ``ray.init`` took and the seconds waited."""
    from bench.process_tree import wait_until_idle
    from ray_workloads import batch_inference
    from rayline import ray_cluster, storage

    began = time.perf_counter()
    ray_cluster.connect(preload=batch_inference.WORKER_PRELOAD)
    connect_s = time.perf_counter() - began
    idle_wait_s = wait_until_idle()
    cfg = batch_inference.InferenceConfig(
        input_uri=spec["input"],
        tables_root=storage.join(spec["root"], "tables", spec["name"]),
        dt=DAY,
        model=version,
        code_version="bench",
        **settings,
    )
    return cfg, connect_s, idle_wait_s
