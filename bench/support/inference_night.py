"""The rayline side of a batch-inference measurement, up to the run: connect, wait for quiet, the night's config.

Shared by the digits (bench/batch_inference.py) and the photos (bench/support/resnet_inference.py).
"""

from __future__ import annotations

import time
from typing import Any

DAY = "2026-11-28"


def connect_for_night(spec: dict[str, Any], version: Any, **settings: Any) -> tuple[Any, float, float]:
    """Connect as tasks/batch_inference.py does and wait until the machine is idle; returns the night's
    ``InferenceConfig`` (``settings`` on top), the seconds ``ray.init`` took and the seconds waited."""
    from bench.support.process_tree import wait_until_idle
    from rayline import ray_cluster, storage
    from rayline.ray_workloads.nightly import batch_inference

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


def register_untrained(name: str, side: int = 32, champion: bool = True) -> Any:
    """An untrained ``small_cnn`` of the default width, registered (as champion by default): a bench's model.

    Throughput does not depend on the weights. ``RAYLINE_STORAGE`` names the registry's storage.
    """
    from rayline.models import registry
    from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
    from rayline.specs import squash

    spec = ModelSpec(num_classes=10)
    version = registry.register(
        name,
        state_dict_bytes(build_model(spec)),
        model_spec=spec,
        image_spec=squash(side),
        classes=[str(i) for i in range(10)],
        metrics={"test_accuracy": 0.1},
        data_manifest_uri="-",
        data_content_hash="-",
        code_version="bench",
    )
    if champion:
        registry.set_alias(name, registry.CHAMPION, version.version, "bench")
    return version
