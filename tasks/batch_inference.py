"""Prefect task: nightly batch inference of one night, committed to the predictions tables."""

from __future__ import annotations

from prefect import get_run_logger

from rayline import ray_cluster
from rayline.errors import NightCommittedElsewhere
from rayline.ray_workloads.nightly import batch_inference
from rayline.skipped import skipped_text
from rayline.tasks.common import idempotency_key, io_task, lease_holder, ray_task, record_lineage


@ray_task("batch-inference", preload=batch_inference.WORKER_PRELOAD)
def batch_inference_task(
    config: batch_inference.InferenceConfig,
) -> batch_inference.InferenceResult | batch_inference.NightSkipped:
    """Run the night; a night another run committed meanwhile ends this one cleanly (nothing to retry)."""
    logger = get_run_logger()
    try:
        # one run id for every attempt of this task run: a retry after the commit returns it, predicting nothing
        run_id = f"task-{idempotency_key(config.model.name, config.dt)[:24]}"
        # the night's lease names this flow run: its retries re-enter it, other runs wait for it
        result = batch_inference.run(config.model_copy(update={"holder": config.holder or lease_holder()}), run_id)
    except NightCommittedElsewhere as exc:
        # a retry would replace the other run's commit with the same predictions: stop here, Completed
        logger.warning("%s; this run's files stay uncommitted until a vacuum", exc)
        return batch_inference.NightSkipped(
            model_name=config.model.name, dt=config.dt, committed_by=exc.winner_run_id, message=str(exc)
        )
    logger.info(
        "%s: %d inputs → %d predictions, %d errors %s with %s in %.1fs; predictions v%d, prediction_errors v%d%s",
        result.night,
        result.inputs,
        result.predictions,
        result.errors,
        result.error_types,
        result.model,
        result.elapsed_s,
        result.predictions_version,
        result.errors_version,
        f"; skipped {skipped_text(result.skipped)}: e.g. {result.skipped_examples}" if result.skipped else "",
    )
    # Ray Data's own logs stay in the Ray workers and its session folder: publish its stats from here
    logger.info("phases (s): %s; Ray Data execution stats:\n%s", result.phase_s, result.ray_data_stats)
    record_lineage("batch_inference", result, parameters=config.model_dump(mode="json"))
    return result


@io_task("cluster-cpus")
def cluster_cpus_task() -> float:
    """The cluster's logical CPUs, for sizing a backfill; connects as a night does, so the preload applies."""
    return ray_cluster.connect(preload=batch_inference.WORKER_PRELOAD).num_cpus
