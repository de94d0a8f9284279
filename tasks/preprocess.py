"""Prefect task: decode, normalise and split ingested images."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_run_logger

from ray_workloads import preprocess
from rayline import ray_cluster
from rayline.lineage import DatasetRef
from tasks.common import folder_wait_text, lease_holder, log_ray_data_stats, ray_task, record_lineage


@ray_task("preprocess")
def preprocess_images(config: preprocess.PreprocessConfig) -> preprocess.PreprocessResult:
    started = datetime.now(UTC)
    connection = ray_cluster.connect()
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
    record_lineage(
        stage="preprocess",
        started_at=started,
        inputs=[DatasetRef(uri=result.input_manifest_uri, content_hash=result.input_content_hash)],
        outputs=[
            DatasetRef(
                uri=result.manifest_uri,
                content_hash=result.input_content_hash,
                facets={"files": result.files, "counts": result.counts, "error_count": result.error_count},
            )
        ],
        parameters=config.model_dump(mode="json"),
        connection=connection,
        cached=result.cached,
    )
    return result
