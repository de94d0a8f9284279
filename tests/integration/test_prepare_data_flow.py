"""The prepare-data flow against a real Prefect API: from the command line on local storage, then on S3, GCS and
Azure."""

from __future__ import annotations

import asyncio

import boto3
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from typer.testing import CliRunner

from rayline import lineage, storage
from rayline.cli import app
from rayline.flows.prepare_data import prepare_data
from rayline.ray_workloads.data import ingest, preprocess
from rayline.seed import seed
from tests.integration.helpers import assert_exactly_one_row_per_object

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]


async def _artifact_keys() -> set[str]:
    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prepare-data-counts", "prepare-data-errors"]))
        )
    return {a.key for a in artifacts if a.key}


def _printed(output: str, label: str) -> str:
    """The value on the line ``label`` of the command's summary."""
    (line,) = [line for line in output.splitlines() if line.startswith(f"  {label} ")]
    return line.removeprefix(f"  {label}").strip()


def test_command_on_local_storage_prints_its_summary_and_records_lineage_and_artifacts(local_storage: str) -> None:
    seeded = seed(storage.join(local_storage, "raw"), corrupt=4)
    done = CliRunner().invoke(app, ["prepare-data"])
    assert done.exit_code == 0, done.output
    assert "prepare-data finished" in done.output
    assert f"objects ingested   {seeded.total} from {seeded.uri}" in done.output
    assert asyncio.run(_artifact_keys()) == {"prepare-data-counts", "prepare-data-errors"}

    (ingest_record,) = lineage.read_records("ingest")
    (pre_record,) = lineage.read_records("preprocess")
    # the records name what the command printed
    ingest_manifest, content_hash = _printed(done.output, "ingest manifest"), _printed(done.output, "content hash")
    assert ingest_record.inputs[0].uri == seeded.uri
    assert ingest_record.inputs[0].content_hash == content_hash
    assert ingest_record.outputs[0].uri == ingest_manifest
    assert pre_record.inputs[0].uri == ingest_manifest
    assert pre_record.inputs[0].content_hash == content_hash
    ingested = ingest.read_manifest(ingest_manifest)
    prepared = preprocess.read_manifest(pre_record.outputs[0].uri)
    assert prepared.output_uri == _printed(done.output, "preprocessed")
    assert prepared.summary_uri == _printed(done.output, "summary")

    assert ingested.object_count == seeded.total == seeded.digits + 4
    assert prepared.error_count == 4 and sum(prepared.counts.values()) == seeded.digits
    assert_exactly_one_row_per_object(prepared, seeded)
    summary = storage.read_json(prepared.summary_uri)
    assert summary["error_count"] == 4 and summary["counts"] == prepared.counts
    assert sum(summary["class_counts"]["train"].values()) == prepared.counts["train"]

    shard_uris = ingested.read_shard_uris()  # listed by the manifest, the record's output: counted there
    assert shard_uris and ingest_record.outputs[0].facets == {"shard_count": len(shard_uris)}
    for record in (ingest_record, pre_record):
        assert record.code_version.startswith(("git:", "pkg:"))
        assert record.run.flow_name == "prepare-data"
        assert record.run.flow_run_id and record.run.task_run_id and record.run.ray_job_id
        assert record.parameters
    assert ingest_record.run.flow_run_id == pre_record.run.flow_run_id
    assert ingest_record.run.task_run_id != pre_record.run.task_run_id

    # the shards themselves pin every raw object to its etag
    shard_rows = storage.read_parquet(shard_uris).select(["uri", "etag"]).to_pylist()
    listed = {storage.join(seeded.uri, o.key): o.etag for o in storage.list_objects(seeded.uri)}
    assert {r["uri"]: r["etag"] for r in shard_rows} == listed


def test_flow_on_s3_writes_everything_to_the_bucket(s3_storage: str, s3_bucket: str, s3_endpoint: str) -> None:
    seeded = seed(storage.join(s3_storage, "raw"), corrupt=4, digit_count=300)  # every class; few S3 requests
    result = prepare_data()
    assert result.ingest.manifest_uri.startswith(f"s3://{s3_bucket}/root/ingested/")
    assert_exactly_one_row_per_object(result.preprocess, seeded)

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    keys = {
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
        for obj in page.get("Contents", [])
    }
    prefix = result.preprocess.output_uri.removeprefix(f"s3://{s3_bucket}/")
    files = result.preprocess.summary_uri.removeprefix(f"s3://{s3_bucket}/").rsplit("/", 1)[0]  # its generation
    assert files.startswith(f"{prefix}/gen-")
    assert f"{prefix}/manifest.json" in keys and f"{files}/summary.json" in keys
    assert any(k.startswith(f"{files}/errors/") for k in keys)
    assert any(k.startswith(f"{files}/train/") for k in keys)
    assert sum(k.startswith("root/ingested/") and k.endswith(".parquet") for k in keys) == result.ingest.shard_count
    assert any(k.startswith("root/lineage/ingest/") for k in keys)

    # a rerun on unchanged input: same hashes, no new or rewritten objects
    etags = {o.key: o.etag for o in storage.list_objects(s3_storage) if "/lineage/" not in f"/{o.key}"}
    again = prepare_data()
    assert again.ingest.content_hash == result.ingest.content_hash
    assert again.preprocess.manifest_uri == result.preprocess.manifest_uri
    assert {o.key: o.etag for o in storage.list_objects(s3_storage) if "/lineage/" not in f"/{o.key}"} == etags


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_flow_on_gcs_and_azure_keeps_everything_in_the_store_and_a_rerun_rewrites_nothing(
    store: str, request: pytest.FixtureRequest
) -> None:
    """The same flow on ``gs://`` (fake-gcs-server) and ``az://`` (Azurite): only the URI and the credentials
    change. A rerun on unchanged input finds every object at the version it wrote (generation, ETag)."""
    root = str(request.getfixturevalue(f"{store}_storage"))
    seeded = seed(storage.join(root, "raw"), corrupt=4, digit_count=300)
    result = prepare_data()
    assert result.ingest.manifest_uri.startswith(f"{root}/ingested/")
    assert result.preprocess.manifest_uri.startswith(root)
    assert_exactly_one_row_per_object(result.preprocess, seeded)
    versions = {o.key: o.etag for o in storage.list_objects(root) if "/lineage/" not in f"/{o.key}"}
    again = prepare_data()
    assert again.ingest.content_hash == result.ingest.content_hash
    assert again.preprocess.manifest_uri == result.preprocess.manifest_uri
    assert {o.key: o.etag for o in storage.list_objects(root) if "/lineage/" not in f"/{o.key}"} == versions
