"""Prefect task: nightly batch inference over one input partition."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_run_logger

from ray_workloads import batch_inference
from rayline import ray_cluster
from rayline.lineage import DatasetRef
from tasks.common import ray_task, record_lineage


@ray_task("batch-inference")
def batch_inference_task(config: batch_inference.InferenceConfig) -> batch_inference.InferenceResult:
    started = datetime.now(UTC)
    connection = ray_cluster.connect(preload=batch_inference.WORKER_PRELOAD)
    result = batch_inference.run(config)
    logger = get_run_logger()
    logger.info(
        "%s: %d inputs → %d predictions, %d errors %s with %s in %.1fs",
        result.partition_uri,
        result.inputs,
        result.predictions,
        result.errors,
        result.error_types,
        result.model,
        result.elapsed_s,
    )
    # Ray Data's own logs stay in the Ray workers and its session folder: publish its stats from here
    logger.info("phases (s): %s; Ray Data execution stats:\n%s", result.phase_s, result.ray_data_stats)
    record_lineage(
        stage="batch_inference",
        started_at=started,
        inputs=[
            DatasetRef(uri=config.input_uri, content_hash=result.input_content_hash),
            DatasetRef(uri=config.model.weights_uri, facets={"model": result.model}),
        ],
        outputs=[DatasetRef(uri=result.manifest_uri, facets={"run_id": result.run_id, "files": result.files})],
        parameters=config.model_dump(mode="json"),
        connection=connection,
    )
    return result
