"""Flow ``prepare-data``: ingest raw objects, then decode/normalise/split them."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from rayline.config import get_settings
from rayline.ray_workloads.data.ingest import IngestConfig, IngestResult
from rayline.ray_workloads.data.preprocess import PreprocessConfig, PreprocessResult, error_sample
from rayline.ray_workloads.data.request import PrepareRequest as PrepareRequest  # callers import it with the flow
from rayline.storage.layout import INGESTED_DIR, PREPROCESSED_DIR, RAW_DIR, under_root
from rayline.tasks.flow_lineage import openlineage_flow
from rayline.tasks.ingest import ingest_objects
from rayline.tasks.preprocess import preprocess_images
from rayline.tasks.registry_lookups import requested_version


class PrepareDataResult(BaseModel):
    ingest: IngestResult
    preprocess: PreprocessResult


def _publish_summary(ingested: IngestResult, prepared: PreprocessResult) -> None:
    rows = [{"split": split, "images": count} for split, count in prepared.counts.items()]
    rows.append({"split": "errors", "images": prepared.error_count})
    rows.append({"split": "total objects", "images": ingested.object_count})
    for reason, count in ingested.skipped.items():  # listed, yet no input: no row anywhere else
        rows.append({"split": f"skipped: {reason}", "images": count})
    create_table_artifact(
        key="prepare-data-counts",
        table=rows,
        description=(
            f"Source `{ingested.source_uri}` (content hash `{ingested.content_hash[:12]}`) → "
            f"`{prepared.output_uri}`. Classes: {', '.join(prepared.classes)}."
        ),
    )
    sample = error_sample(prepared, limit=20)
    if sample:
        create_table_artifact(
            key="prepare-data-errors",
            table=[{k: row[k] for k in ("uri", "stage", "error_type", "error_message")} for row in sample],
            description=f"{prepared.error_count} objects could not be used: first {len(sample)} shown.",
        )


@openlineage_flow
@flow(name="prepare-data")
def prepare_data(request: PrepareRequest = PrepareRequest()) -> PrepareDataResult:  # noqa: B008  # frozen: one default
    """Ingest the request's source (default ``<storage>/raw``) and preprocess it for training.

    The preprocessed folder's name hashes the image spec. New objects are announced (``rayline.data.arrived``);
    without ``announce_retrain`` they never ask for a retraining: the caller is about to train on this data
    itself (``train_model``), so a triggered run would repeat it.
    """
    settings = get_settings()
    like = requested_version(request.like, None).image_spec if request.like else None  # refused before any work
    ingested = ingest_objects(
        IngestConfig(
            source_uri=request.source_uri or under_root(RAW_DIR),
            output_root=under_root(INGESTED_DIR),
            io_concurrency=settings.io_concurrency,
            force=request.force,
        ),
        announce_retrain=request.announce_retrain,
    )
    prepared = preprocess_images(
        PreprocessConfig(
            ingest_manifest_uri=ingested.manifest_uri,
            output_root=under_root(PREPROCESSED_DIR),
            image=request.image_spec(like),
            force=request.force,
        )
    )
    _publish_summary(ingested, prepared)
    return PrepareDataResult(ingest=ingested, preprocess=prepared)
