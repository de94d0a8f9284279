"""Prefect task: decode, normalise and split ingested images."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ray_workloads import preprocess
from rayline import ray_cluster
from rayline.lineage import DatasetRef
from tasks.common import DEFAULT_TIMEOUT_S, RETRY_DELAYS_S, RETRY_JITTER, record_lineage, retry_if_transient


@task(
    name="preprocess",
    retries=len(RETRY_DELAYS_S),
    retry_delay_seconds=RETRY_DELAYS_S,
    retry_jitter_factor=RETRY_JITTER,
    retry_condition_fn=retry_if_transient,
    timeout_seconds=DEFAULT_TIMEOUT_S,
    cache_policy=NO_CACHE,  # the workload itself reuses committed output
    persist_result=False,
)
def preprocess_images(config: preprocess.PreprocessConfig) -> preprocess.PreprocessResult:
    started = datetime.now(UTC)
    connection = ray_cluster.connect()
    result = preprocess.run(config)
    get_run_logger().info(
        "preprocess: %s ok per split, %d errors %s%s in %.1fs",
        result.counts,
        result.error_count,
        result.error_types,
        " (reused)" if result.cached else "",
        result.elapsed_s,
    )
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
