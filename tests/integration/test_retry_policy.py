"""Prefect retries transient failures only: a dead S3 endpoint is retried, bad input is not."""

from __future__ import annotations

import asyncio
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from rayline import storage
from rayline.ray_workloads.data.ingest import IngestConfig
from rayline.tasks.ingest import ingest_objects
from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]


async def _run_count(task_run_id: UUID) -> int:
    async with get_client() as client:
        return (await client.read_task_run(task_run_id)).run_count


def _ingest_once(config: IngestConfig) -> tuple[str, int, str]:
    fast = ingest_objects.with_options(retry_delay_seconds=0, retry_jitter_factor=None)

    @flow(name="retry-probe")
    def probe() -> tuple[str, UUID | None, str]:
        state = fast(config, return_state=True)
        message = ""
        try:
            state.result()
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
        return state.type.value, state.state_details.task_run_id, message

    state_type, task_run_id, message = probe()
    assert task_run_id is not None
    return state_type, asyncio.run(_run_count(task_run_id)), message


def test_unreachable_s3_is_retried(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    config = IngestConfig(source_uri=f"s3://{s3_bucket}/raw", output_root=f"s3://{s3_bucket}/out")
    state_type, runs, message = _ingest_once(config)
    assert state_type == "FAILED"
    assert runs == 4, "3 retries expected for a transient failure"
    assert "TransientStorageError" in message and "listing" in message


def test_bad_input_fails_at_once_with_its_name(local_storage: str) -> None:
    missing = storage.join(local_storage, "no-such-prefix")
    state_type, runs, message = _ingest_once(IngestConfig(source_uri=missing, output_root=local_storage))
    assert state_type == "FAILED"
    assert runs == 1
    assert f"no objects found under {missing}" in message
