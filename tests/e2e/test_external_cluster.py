"""The CLI against an external `ray start --head` cluster and S3: prepare-data, train-model, nightly-inference."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from rayline import lineage, storage
from rayline.ray_workloads.data import preprocess
from rayline.seed import SeedResult, seed, seed_incoming
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, table_uri
from rayline.tables.delta_tables import Night, table_version
from rayline.tables.prediction_reads import read_night_pair, vacuum
from tests.integration.helpers import assert_exactly_one_row_per_object, register_untrained_champion
from tests.support import (
    create_bucket,
    delete_bucket,
    free_port,
    node_port_flags,
    pids_mentioning,
    start_ray_head,
    stop_process,
    wait_for_port,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("ray_session")]

BIN = Path(sys.executable).parent


def _driver_env(cluster: str, root: str, endpoint: str, prefect_api: str) -> dict[str, str]:
    """A driver joining the external cluster with token auth, storing in the bucket."""
    return {
        **os.environ,
        "RAY_ADDRESS": cluster,
        "RAY_AUTH_MODE": "token",
        "RAYLINE_STORAGE": root,
        "AWS_ENDPOINT_URL": endpoint,
        "PREFECT_API_URL": prefect_api,
        # a killed driver's night lease expires in 15 s, not 60: the rerun of the kill drill waits that long
        "RAYLINE_LEASE_TTL_S": "15",
    }


@pytest.fixture(scope="module")
def external_cluster(s3_endpoint: str) -> Iterator[str]:
    """A head node of our own: loopback, free ports, its own temp dir; stopped by PID."""
    temp_dir = tempfile.mkdtemp(prefix="rl-ext-", dir="/tmp")  # short: unix socket paths are limited
    port = free_port()
    # The head gets credentials but NOT the endpoint: the driver must forward it.
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ENDPOINT_URL", "RAY_ADDRESS")}
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "2"  # nothing to drain in a test
    args = [
        str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
        f"--temp-dir={temp_dir}", "--min-worker-port=20000", "--max-worker-port=20999",
    ]  # fmt: skip
    head = start_ray_head(lambda: [*args, *node_port_flags()], env, Path(temp_dir))
    try:
        wait_for_port(port)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(head, timeout_s=60)
        deadline = time.monotonic() + 30
        while pids_mentioning(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pids_mentioning(temp_dir) == [], "processes of the external cluster survived its stop"


@dataclass(frozen=True)
class Prepared:
    """The module's one `rayline prepare-data` on the external cluster: its storage root, what was seeded, its run."""

    root: str
    seeded: SeedResult
    done: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def prepared(external_cluster: str, s3_endpoint: str, prefect_api: str) -> Iterator[Prepared]:
    """300 digits (every class; few S3 requests) and 4 broken objects, prepared once in a bucket of the module's:
    train-model then finds its data prepared (ingest and preprocess reused), as after a user's prepare-data,
    and spends its time on the tune and train it is tested for."""
    bucket = f"rayline-test-{uuid.uuid4().hex[:12]}"
    create_bucket(s3_endpoint, bucket)
    root = f"s3://{bucket}/root"
    try:
        seeded = seed(storage.join(root, "raw"), corrupt=4, digit_count=300)
        env = _driver_env(external_cluster, root, s3_endpoint, prefect_api)
        # run from outside the repo: workers must get rayline from runtime_env, not the cwd
        done = subprocess.run(
            [str(BIN / "rayline"), "prepare-data"], env=env, cwd=tempfile.gettempdir(), capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        yield Prepared(root, seeded, done)
    finally:
        delete_bucket(s3_endpoint, bucket)


def test_prepare_data_runs_on_an_external_cluster(
    prepared: Prepared, external_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYLINE_STORAGE", prepared.root)
    done = prepared.done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "prepare-data finished" in done.stdout

    # the prepare-data run's record (train-model's reuse of its data, when it ran first, records a cached one)
    (record,) = [r for r in lineage.read_records("preprocess") if not r.cached]
    assert record.run.ray_address == external_cluster
    result = preprocess.read_manifest(record.outputs[0].uri)
    assert_exactly_one_row_per_object(result, prepared.seeded)
    # the session's own embedded cluster was not disturbed
    assert ray.get(ray.put(41)) + 1 == 42


def test_train_and_tune_run_on_an_external_cluster(
    prepared: Prepared, external_cluster: str, s3_endpoint: str, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = prepared.root  # where it runs is checked, not what it learns: the module's 300 prepared digits
    monkeypatch.setenv("RAYLINE_STORAGE", root)
    env = _driver_env(external_cluster, root, s3_endpoint, prefect_api)
    args = ["train-model", "--epochs", "1", "--tune-samples", "2", "--tune-max-epochs", "1", "--floor", "0"]
    done = subprocess.run(
        [str(BIN / "rayline"), *args], env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "train-model finished" in done.stdout and "2 trials" in done.stdout

    (trained,) = lineage.read_records("train")
    (tuned,) = lineage.read_records("tune")
    assert trained.run.ray_address == tuned.run.ray_address == external_cluster
    assert trained.outputs[0].uri.startswith(f"{root}/checkpoints/training/")  # checkpoints live in the bucket
    assert tuned.outputs[0].uri.startswith(f"{root}/checkpoints/tuning/")
    assert storage.list_objects(storage.join(root, "models", "digits", "v1"))


def _committed(root: str) -> tuple[int | None, int | None]:
    """The versions of both tables: what readers see."""
    return table_version(table_uri(root, PREDICTIONS_TABLE)), table_version(table_uri(root, ERRORS_TABLE))


def _part_files(root: str, night: Night) -> set[str]:
    """Every data file on storage under the night's folder of the predictions table, committed or not."""
    folder = storage.join(table_uri(root, PREDICTIONS_TABLE), night.relative_dir)
    return {o.uri for o in storage.list_objects(folder)}


def test_nightly_inference_on_an_external_cluster_survives_a_driver_killed_before_commit(
    external_cluster: str, s3_storage: str, s3_endpoint: str, prefect_api: str
) -> None:
    day = "2026-11-28"
    register_untrained_champion()
    arrivals = seed_incoming(storage.join(s3_storage, "incoming", f"dt={day}"), corrupt=4)
    inputs = {storage.join(arrivals.uri, o.key) for o in storage.list_objects(arrivals.uri)}
    night = Night("digits", day)
    env = _driver_env(external_cluster, s3_storage, s3_endpoint, prefect_api)
    command = [str(BIN / "rayline"), "nightly-inference", "--date", day]

    def predicted_once() -> None:
        pair = read_night_pair(s3_storage, "digits", day)
        predictions, errors = pair.predictions, pair.errors
        uris = predictions.column("uri").to_pylist() + errors.column("uri").to_pylist()
        assert sorted(uris) == sorted(inputs) and errors.num_rows == 4

    done = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{len(inputs)} inputs → {len(inputs) - 4} predictions + 4 errors" in done.stdout
    predicted_once()
    committed, committed_files = _committed(s3_storage), _part_files(s3_storage, night)

    # A second run for the same day, its driver killed once it has staged output but before it commits.
    slow = [*command, "--batch-size", "8", "--actors", "1"]  # many small batches: a wide window to kill in
    driver = subprocess.Popen(slow, env=env, cwd=tempfile.gettempdir(), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _part_files(s3_storage, night) - committed_files and time.monotonic() < deadline:
            assert driver.poll() is None, "the run ended before it staged anything"
            time.sleep(0.2)
        assert _committed(s3_storage) == committed, "the run committed before it could be killed"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver's whole session: it started nothing else
        driver.wait(timeout=60)
    orphans = _part_files(s3_storage, night) - committed_files
    assert orphans, "staged output of the killed run is there"
    assert _committed(s3_storage) == committed, "the killed run changed the committed night"
    predicted_once()  # the killed run's files are invisible: readers go by the Delta log

    # the rerun takes the night's lease once the killed driver's expires, and resumes its blocks
    done = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "blocks of an earlier attempt reused" in done.stdout, done.stdout[-3000:]
    predicted_once()
    assert _committed(s3_storage) == tuple(v + 1 for v in committed if v is not None), "one commit per table"
    # the killed run's blocks were reused and, once committed, removed; what is left unreferenced (the
    # replaced run's files) is what a vacuum finds
    left = _part_files(s3_storage, night)
    assert not orphans & left
    unreferenced = vacuum(table_uri(s3_storage, PREDICTIONS_TABLE), retention_hours=0, allow_short_retention=True)
    prefix = table_uri(s3_storage, PREDICTIONS_TABLE) + "/"
    assert {uri.removeprefix(prefix) for uri in committed_files} <= set(unreferenced)
    assert {uri.removeprefix(prefix) for uri in left} - set(unreferenced) == {
        uri.removeprefix(prefix) for uri in left if "/part-" in uri and uri not in committed_files
    }, "only the rerun's committed files are referenced"
