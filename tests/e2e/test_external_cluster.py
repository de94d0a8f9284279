"""The CLI against an external cluster and S3: train-model with its prepare, nightly-inference.

The cluster is the Ray head of the package's `rayline up` (conftest.platform), a `ray start --head` with token
auth, shared with test_platform and test_work_pool: one head start fewer. Its environment has S3 credentials but
not the endpoint, so the driver must forward it, and a RAYLINE_STORAGE of its own, which the driver's must
override. The drivers keep the session's Prefect API: the platform's runs, logs and event triggers stay
test_platform's, and the lineage checked here names the cluster by RAY_ADDRESS whichever API records the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from rayline import lineage, storage
from rayline.ray_workloads.data import preprocess
from rayline.seed import SeedResult, seed
from rayline.storage.layout import (
    CHECKPOINTS_DIR,
    ERRORS_TABLE,
    LINEAGE_DIR,
    MODELS_DIR,
    PREDICTIONS_TABLE,
    PREPROCESSED_DIR,
    STAGING_DIR,
)
from rayline.tables.prediction_reads import read_night_pair
from tests.integration.helpers import assert_exactly_one_row_per_object, register_untrained_champion
from tests.support import create_bucket, delete_bucket

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
    }


@pytest.fixture(scope="module")
def external_cluster(platform: dict[str, str]) -> str:
    """The platform's Ray head; stopped, and checked to leave no process behind, by the platform's teardown."""
    assert "AWS_ENDPOINT_URL" not in platform, "the head must not know the endpoint: the driver forwards it"
    return platform["RAY_ADDRESS"]


def _assert_platform_root_untouched(platform: dict[str, str]) -> None:
    """The head's workers see the platform's RAYLINE_STORAGE: none of the drivers' data may land there (the
    platform's registry is test_platform's and test_work_pool's)."""
    written = {p.name for p in Path(platform["RAYLINE_STORAGE"]).iterdir()}
    ours = {MODELS_DIR, LINEAGE_DIR, CHECKPOINTS_DIR, STAGING_DIR, PREPROCESSED_DIR, PREDICTIONS_TABLE, ERRORS_TABLE}
    assert not written & ours, sorted(written)


@dataclass(frozen=True)
class Trained:
    """The module's one `rayline train-model` on the external cluster: its storage root, what was seeded, its run."""

    root: str
    seeded: SeedResult
    done: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def trained(external_cluster: str, s3_endpoint: str, prefect_api: str) -> Iterator[Trained]:
    """300 digits (every class; few S3 requests) and 4 broken objects in a bucket of the module's, unprepared:
    train-model prepares them itself on the cluster, then tunes and trains on them."""
    bucket = f"rayline-test-{uuid.uuid4().hex[:12]}"
    create_bucket(s3_endpoint, bucket)
    root = f"s3://{bucket}/root"
    try:
        seeded = seed(storage.join(root, "raw"), corrupt=4, digit_count=300)
        env = _driver_env(external_cluster, root, s3_endpoint, prefect_api)
        args = ["train-model", "--epochs", "1", "--tune-samples", "2", "--tune-max-epochs", "1", "--floor", "0"]
        # run from outside the repo: workers must get rayline from runtime_env, not the cwd
        done = subprocess.run(
            [str(BIN / "rayline"), *args], env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
            timeout=900,
        )  # fmt: skip
        yield Trained(root, seeded, done)
    finally:
        delete_bucket(s3_endpoint, bucket)


def test_train_model_prepares_its_data_on_an_external_cluster(
    trained: Trained, external_cluster: str, platform: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYLINE_STORAGE", trained.root)
    done = trained.done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    (record,) = lineage.read_records("preprocess")
    assert not record.cached and record.run.ray_address == external_cluster
    result = preprocess.read_manifest(record.outputs[0].uri)
    assert_exactly_one_row_per_object(result, trained.seeded)
    # the session's own embedded cluster was not disturbed
    assert ray.get(ray.put(41)) + 1 == 42
    _assert_platform_root_untouched(platform)


def test_train_model_tunes_and_trains_on_an_external_cluster(
    trained: Trained, external_cluster: str, platform: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = trained.root  # where it runs is checked, not what it learns: the module's 300 digits
    monkeypatch.setenv("RAYLINE_STORAGE", root)
    done = trained.done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "train-model finished" in done.stdout and "2 trials" in done.stdout

    (trained_record,) = lineage.read_records("train")
    (tuned,) = lineage.read_records("tune")
    assert trained_record.run.ray_address == tuned.run.ray_address == external_cluster
    assert trained_record.outputs[0].uri.startswith(f"{root}/checkpoints/training/")  # checkpoints live in the bucket
    assert tuned.outputs[0].uri.startswith(f"{root}/checkpoints/tuning/")
    assert storage.list_objects(storage.join(root, "models", "digits", "v1"))
    _assert_platform_root_untouched(platform)


def test_nightly_inference_runs_on_an_external_cluster(
    external_cluster: str, platform: dict[str, str], s3_storage: str, s3_endpoint: str, prefect_api: str
) -> None:
    """The CLI's night on the user's own cluster and bucket, each input once. A driver killed before its commit,
    and the rerun that takes its lease over and reuses its blocks, are drilled by test_night_at_scale: the
    killed driver a process with a Ray cluster of its own, the rerun on the session's cluster."""
    day = "2026-11-28"
    register_untrained_champion()
    # a few hundred arrivals: where the night runs is checked, not its scale
    arrivals = seed(storage.join(s3_storage, "incoming", f"dt={day}"), corrupt=4, digit_count=300)
    inputs = {storage.join(arrivals.uri, o.key) for o in storage.list_objects(arrivals.uri)}
    env = _driver_env(external_cluster, s3_storage, s3_endpoint, prefect_api)
    command = [str(BIN / "rayline"), "nightly-inference", "--date", day]

    done = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{len(inputs)} inputs → {len(inputs) - 4} predictions + 4 errors" in done.stdout
    pair = read_night_pair(s3_storage, "digits", day)
    uris = pair.predictions.column("uri").to_pylist() + pair.errors.column("uri").to_pylist()
    assert sorted(uris) == sorted(inputs) and pair.errors.num_rows == 4
    (record,) = lineage.read_records("batch_inference")
    assert record.run.ray_address == external_cluster
    _assert_platform_root_untouched(platform)
