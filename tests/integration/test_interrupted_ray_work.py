"""An interrupted attempt stops the Ray work it started, and only that (``rayline.ray_work``).

A timed-out ingest cancels its fetch tasks before a retry clears and refills
the folder; a backfill night that times out stops its own Ray Data execution
(its predictor actors) while a sibling night, running beside it in the same
process, goes on and commits.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from prefect.futures import PrefectFuture

from rayline import ray_work, storage
from rayline.errors import NightsFailed, WorkTimedOut
from rayline.flows import nightly_backfill
from rayline.flows.nightly_inference import NightRequest, nightly_inference
from rayline.ray_workloads.data import ingest
from rayline.ray_workloads.nightly import batch_inference as bi
from rayline.ray_workloads.nightly.batch_inference import InferenceConfig
from rayline.ray_workloads.nightly.request import NightShape
from rayline.seed import digit_objects
from rayline.storage import manifests
from rayline.storage.manifests import IngestManifest
from rayline.tasks.batch_inference import batch_inference_task
from rayline.testing.fault_proxy_control import FaultProxy
from tests.integration.helpers import (
    HUNG_MARK,
    SIBLING_MARK,
    HangsOneNight,
    register_untrained_champion,
    running_pids,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

HUNG, SIBLING = "2026-11-20", "2026-11-21"
# the hung night's limit: past its actor's start (it marks itself then), well before the sibling gives up
HUNG_TIMEOUT_S = 45


def _cpus_back_to(idle: float, within_s: float = 10.0) -> float:
    """The cluster's free CPUs once they are back to ``idle`` (or what they are at the deadline)."""
    deadline = time.monotonic() + within_s
    free = float(ray.available_resources().get("CPU", 0.0))
    while free < idle and time.monotonic() < deadline:
        time.sleep(0.2)
        free = float(ray.available_resources().get("CPU", 0.0))
    return free


def test_a_timed_out_ingest_cancels_its_fetch_tasks_before_the_retry_clears_the_folder(
    s3_faults: FaultProxy, s3_storage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw = storage.join(s3_storage, "raw")
    count = ingest.MAX_SHARDS_IN_FLIGHT + 4  # more shards than wait at once: the driver waits among them
    for i in range(count):
        storage.write_bytes_atomic(storage.join(raw, f"0/{i:03d}.png"), b"x")
    idle = float(ray.available_resources().get("CPU", 0.0))
    # one fetch task at a time (each takes every free CPU), each a second long: the attempt would take minutes
    slow = ingest.IngestConfig(
        source_uri=raw,
        output_root=str(tmp_path / "ingested"),
        shard_max_objects=1,
        io_concurrency=1,
        num_cpus_per_task=idle,
    )
    # the objects' GETs only: a slow listing would let the limit pass before the first fetch task starts
    s3_faults.configure(latency_ms=1000, latency_regex=r"\.png$")
    with pytest.raises(WorkTimedOut), ray_work.cancel_on_abort("an ingest attempt", timeout_s=4):
        ingest.run(slow)
    stopped = [r.getMessage() for r in caplog.records if "an ingest attempt interrupted" in r.getMessage()]
    assert stopped and " 0 task(s)" not in stopped[0], f"the limit passed before a fetch task started: {stopped}"
    assert _cpus_back_to(idle) >= idle, "a fetch task of the timed-out attempt still runs"
    s3_faults.reset()

    retried = ingest.run(slow.model_copy(update={"shard_max_objects": 512, "num_cpus_per_task": 0.25}))
    assert not retried.cached and retried.object_count == count
    shard_uris = retried.read_shard_uris()
    assert storage.read_parquet(shard_uris).num_rows == count
    committed = manifests.read(retried.manifest_uri, IngestManifest)
    shards = storage.join(manifests.files_folder(retried.manifest_uri, committed), "shards")
    assert [storage.join(shards, name) for name in storage.list_names(shards)] == shard_uris, "a stray shard"


def _seed_night(root: str, dt: str, offset: int, count: int = 4) -> None:
    incoming = storage.join(root, "incoming", f"dt={dt}")
    for key, data in itertools.islice(digit_objects(32), offset, offset + count):
        storage.write_bytes_atomic(storage.join(incoming, key), data)


class _HungNightTimesOut:
    """What the backfill submits nights through: the hung night's task with a short limit, the others as they are."""

    def submit(self, config: InferenceConfig) -> PrefectFuture[Any]:
        if config.dt == HUNG:
            return batch_inference_task.with_options(timeout_seconds=HUNG_TIMEOUT_S).submit(config)
        return batch_inference_task.submit(config)


@pytest.mark.usefixtures("prefect_api")
def test_a_backfill_night_timed_out_stops_its_own_actors_while_its_sibling_finishes(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_untrained_champion()
    _seed_night(local_storage, HUNG, 0)
    _seed_night(local_storage, SIBLING, 50)
    marks = Path(local_storage).parent / "marks"
    (marks.parent / "hang.json").write_text(json.dumps({"hang_dt": HUNG}))
    monkeypatch.setattr(bi, "PredictorUDF", HangsOneNight)
    monkeypatch.setattr(nightly_backfill, "batch_inference_task", _HungNightTimesOut())

    request = NightRequest(date_from=HUNG, date_to=SIBLING, shape=NightShape(actors=1), max_concurrent_nights=2)
    state = nightly_inference(request, return_state=True)

    error = state.result(raise_on_failure=False)
    assert isinstance(error, NightsFailed), error
    outcomes = {night.dt: night for night in error.result.nights}
    assert outcomes[HUNG].state == "failed" and re.match("(TaskRunTimeoutError|WorkTimedOut): ", outcomes[HUNG].message)
    assert outcomes[SIBLING].state == "committed" and outcomes[SIBLING].predictions == 4, outcomes[SIBLING]
    hung = [int(p.name[len(HUNG_MARK) :]) for p in marks.glob(f"{HUNG_MARK}*")]
    assert hung, "the hung night's actor never started: nothing of it was running to stop"
    assert not running_pids(hung), "the timed-out night's predictor actors live on"
    assert list(marks.glob(f"{SIBLING_MARK}*")), "the sibling night's actor did not outlive the stop"
