"""Prefect task: ingest objects under a prefix into Parquet shards."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.runtime import task_run

from rayline import events
from rayline.config import get_settings
from rayline.ray_workloads.data import ingest
from rayline.skipped import skipped_text
from rayline.tasks.common import emit, folder_wait_text, lease_holder, ray_task, record_lineage


@ray_task("ingest")
def ingest_objects(config: ingest.IngestConfig, announce_retrain: bool = True) -> ingest.IngestResult:
    # the folder's lease names this flow run, so a run that waits for it can say which run it waits for
    holder = config.holder or lease_holder()
    result = ingest.run(config.model_copy(update={"holder": holder}))
    get_run_logger().info(
        "ingest %s: %d objects, %d bytes, %d fetch errors, %d shards%s%s in %.1fs%s",
        result.source_uri,
        result.object_count,
        result.total_bytes,
        result.fetch_errors,
        result.shard_count,
        " (reused)" if result.cached else "",
        folder_wait_text(result.waited_s, result.cached, "ingest folder"),
        result.elapsed_s,
        f"; skipped {skipped_text(result.skipped)}: e.g. {result.skipped_examples}" if result.skipped else "",
    )
    record_lineage("ingest", result, parameters=config.model_dump(mode="json"), cached=result.cached)
    # a new input version: say what arrived (a retry too, for its first attempt's version; the event id keeps one)
    committed_by_this_run = (task_run.run_count or 1) > 1 and result.committed_by == holder
    if not result.cached or committed_by_this_run:
        news = ingest.arrivals_since_previous(result)
        if news.new_objects:
            eligible = data_arrived(
                news, may_retrain=announce_retrain, idempotency_key=f"{result.source_uri}@{result.content_hash}"
            )
            get_run_logger().info(
                "%d new objects (%d labelled) under %s%s",
                news.new_objects,
                news.new_labelled,
                news.source_uri,
                ": enough to retrain" if eligible else "",
            )
    return result


def data_arrived(arrivals: ingest.Arrivals, may_retrain: bool = True, idempotency_key: str | None = None) -> bool:
    """Announce new objects under a prefix; True when enough to retrain on (never when not ``may_retrain``)."""
    eligible = may_retrain and arrivals.new_labelled >= get_settings().retrain_min_new_labelled
    emit(
        events.DATA_ARRIVED,
        f"rayline.data.{arrivals.source_uri}",
        payload=arrivals.model_dump(),
        labels={events.RETRAIN_LABEL: "true" if eligible else "false", "rayline.prefix": arrivals.source_uri},
        idempotency_key=idempotency_key,
    )
    return eligible
