"""Prefect task: decode, normalise and split ingested images."""

from __future__ import annotations

from prefect import get_run_logger

from rayline.ray_workloads.data import preprocess
from rayline.tasks.common import folder_wait_text, lease_holder, log_ray_data_stats, ray_task, record_lineage


@ray_task("preprocess")
def preprocess_images(config: preprocess.PreprocessConfig) -> preprocess.PreprocessResult:
    # the folder's lease names this flow run, so a run that waits for it can say which run it waits for
    result = preprocess.run(config if config.holder else config.model_copy(update={"holder": lease_holder()}))
    get_run_logger().info(
        "preprocess: %s ok per split, %d errors %s%s%s in %.1fs",
        result.counts,
        result.error_count,
        result.error_types,
        " (reused)" if result.cached else "",
        folder_wait_text(result.waited_s, result.cached, "preprocessed folder"),
        result.elapsed_s,
    )
    log_ray_data_stats(result.ray_data_stats)
    record_lineage("preprocess", result, parameters=config.model_dump(mode="json"), cached=result.cached)
    return result
