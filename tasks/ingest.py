"""Prefect task: ingest objects under a prefix into Parquet shards."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_run_logger

from ray_workloads import ingest
from rayline import ray_cluster
from rayline.lineage import DatasetRef
from tasks.common import ray_task, record_lineage


@ray_task("ingest")
def ingest_objects(config: ingest.IngestConfig) -> ingest.IngestResult:
    started = datetime.now(UTC)
    connection = ray_cluster.connect()
    result = ingest.run(config)
    get_run_logger().info(
        "ingest %s: %d objects, %d bytes, %d fetch errors, %d shards%s in %.1fs",
        result.source_uri,
        result.object_count,
        result.total_bytes,
        result.fetch_errors,
        len(result.shards),
        " (reused)" if result.cached else "",
        result.elapsed_s,
    )
    record_lineage(
        stage="ingest",
        started_at=started,
        inputs=[
            DatasetRef(
                uri=result.source_uri,
                content_hash=result.content_hash,
                facets={"object_count": result.object_count, "total_bytes": result.total_bytes},
            )
        ],
        outputs=[
            DatasetRef(uri=result.manifest_uri, content_hash=result.content_hash, facets={"shards": result.shard_uris})
        ],
        parameters=config.model_dump(mode="json"),
        connection=connection,
        cached=result.cached,
    )
    return result
