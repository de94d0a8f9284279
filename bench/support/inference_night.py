"""The rayline side of a batch-inference measurement: the bench's models, and nights run as the task runs them."""

from __future__ import annotations

import os
import time
from typing import Any

DAY = "2026-11-28"


def measure_nights(spec: dict[str, Any], version: Any, runs: int = 1, **settings: Any) -> dict[str, Any]:
    """Connect as tasks/batch_inference.py does and wait until the machine is idle (neither timed), then run
    the night ``runs`` times in this job (``settings`` on top of the default ``InferenceConfig``), each
    watched by bench/support/process_tree.py; the cluster and the night's tables are gone after."""
    from bench.support.process_tree import wait_until_idle, watch_tree
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
    if spec.get("registered"):  # as register-model does: the plan measured before the first night (not timed)
        from rayline.ray_workloads.execution.ahead import measure_ahead

        measure_ahead(version, cfg.plan, cfg.cpus_per_actor)
        wait_until_idle()
    figures = []
    for attempt in range(runs):
        if attempt:
            wait_until_idle()
        with watch_tree() as peak:
            began = time.perf_counter()
            result = batch_inference.run(cfg)
            seconds = time.perf_counter() - began
        assert result.inputs == result.predictions == spec["count"], result
        night = {"seconds": seconds, "images_s": result.inputs / seconds, "elapsed_s": result.elapsed_s}
        night["core_seconds"] = result.core_seconds or 0.0  # its actors' CPU and its driver's
        figures.append({**peak, **night, "phases": result.phase_s, "plans": result.plans})
    ray_cluster.disconnect()
    storage.remove_tree(cfg.tables_root)  # both tables of this measurement
    return {"connect_s": connect_s, "idle_wait_s": idle_wait_s, "runs": figures}


def register_untrained(
    name: str, side: int = 32, champion: bool = True, root: str | None = None, arch: str = "small_cnn", seed: int = 0
) -> Any:
    """An untrained ``arch`` (``small_cnn`` of the default width) with 10 classes, registered (as champion by
    default) in the registry under ``root`` (else ``RAYLINE_STORAGE``): a bench's model, since throughput does
    not depend on the weights. ``seed`` picks the weights: two versions of one model differ."""
    import torch

    from rayline.models import registry
    from rayline.ray_workloads.architectures.build import ModelSpec, build_model, imagenet_image_spec, state_dict_bytes
    from rayline.specs import squash

    if root is not None:
        os.environ["RAYLINE_STORAGE"] = root
    spec = ModelSpec(arch=arch, num_classes=10)
    torch.manual_seed(seed)
    version = registry.register(
        name,
        state_dict_bytes(build_model(spec)),
        model_spec=spec,
        image_spec=squash(side) if arch == "small_cnn" else imagenet_image_spec(arch),
        classes=[str(i) for i in range(10)],
        metrics={"test_accuracy": 0.1},
        data_manifest_uri="-",
        data_content_hash="-",
        code_version="bench",
    )
    if champion:
        registry.set_alias(name, registry.CHAMPION, version.version, "bench")
    return version


def resolve_champion(root: str, name: str) -> Any:
    """``name``'s champion in the registry under ``root``: the model a child process measures."""
    from rayline.models import registry

    os.environ["RAYLINE_STORAGE"] = root
    return registry.resolve(name, registry.CHAMPION)
