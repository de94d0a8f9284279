"""Failures Ray already retried are not retried by Prefect; a timed-out task leaves no Ray work behind.

Ray Train restarts its workers ``max_failures`` times and Tune runs every
trial: when all of that failed, a Prefect retry would only run it again. And
Prefect's task timeout raises in the task's thread only: rayline stops the
actors and tasks the attempt started (``rayline.ray_work``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from prefect.task_engine import TaskRunTimeoutError

from rayline import ray_work, storage
from rayline.errors import RetriesExhausted, WorkTimedOut, is_transient
from rayline.ray_workloads.data import ingest, preprocess
from rayline.ray_workloads.training import train, tune
from rayline.ray_workloads.training.loop import TrainLoopConfig
from rayline.seed import digit_objects
from rayline.tasks.common import ray_task
from rayline.tasks.train import train_model_task
from rayline.tasks.tune import tune_task
from tests.integration.helpers import run_task_once, running_pids

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

ALWAYS_FAILS = TrainLoopConfig(epochs=1, batch_size=64, fail_always_at_epoch=0)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A small preprocessed digits set."""
    root = str(tmp_path_factory.mktemp("failure-classes") / "storage")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", root)
        raw = storage.join(root, "raw")
        for key, data in list(digit_objects(32))[:60]:
            storage.write_bytes_atomic(storage.join(raw, key), data)
        ingested = ingest.run(ingest.IngestConfig(source_uri=raw, output_root=storage.join(root, "in")))
        config = preprocess.PreprocessConfig(
            ingest_manifest_uri=ingested.manifest_uri, output_root=storage.join(root, "pre")
        )
        yield preprocess.run(config).manifest_uri


def test_a_train_run_failing_in_every_ray_attempt_is_run_once_by_prefect(manifest: str, tmp_path: Path) -> None:
    config = train.TrainConfig(
        data_manifest_uri=manifest,
        output_root=str(tmp_path),
        run_name="always-fails",
        loop=ALWAYS_FAILS,
        num_workers=1,
        max_failures=1,
    )
    state, attempts = run_task_once(train_model_task, config)

    with pytest.raises(RetriesExhausted, match="failed in all 2 attempt.*InjectedFailure") as failed:
        state.result()
    assert attempts == 1 and not is_transient(failed.value)


def test_a_tune_search_whose_every_trial_fails_is_run_once_by_prefect(manifest: str, tmp_path: Path) -> None:
    config = tune.TuneJobConfig(
        data_manifest_uri=manifest,
        output_root=str(tmp_path),
        experiment_name="all-fail",
        space=tune.SearchSpace(batch_size=[64], width=[8]),
        num_samples=2,
        max_epochs=1,
    )
    state, attempts = run_task_once(tune_task, config, ALWAYS_FAILS)

    with pytest.raises(RetriesExhausted, match="every trial of Tune search all-fail failed in all 2") as failed:
        state.result()
    assert attempts == 1 and not is_transient(failed.value)


def _note_pid(folder: str) -> None:
    Path(folder, str(os.getpid())).touch()


@ray.remote(num_cpus=0.1)
class _Sleeper:
    def nap(self, seconds: float, folder: str) -> None:
        _note_pid(folder)
        time.sleep(seconds)


@ray.remote(num_cpus=0.1, max_retries=3)
def _long_sleep(seconds: float, folder: str) -> None:
    _note_pid(folder)
    time.sleep(seconds)


@ray.remote(num_cpus=0.1)
def _starts_a_nested_sleep(seconds: float, folder: str) -> None:
    _note_pid(folder)
    ray.get(_long_sleep.remote(seconds, folder))


@ray_task("outruns-its-timeout")
def _outruns_its_timeout(folder: str) -> None:
    """Starts an actor and two remote tasks (one nested) that would run for 2 minutes, and waits on them."""
    sleeper = _Sleeper.remote()  # type: ignore[attr-defined]
    refs = [_long_sleep.remote(120, folder), _starts_a_nested_sleep.remote(120, folder)]
    ray_work.track(refs)
    naps = sleeper.nap.remote(120, folder)
    while len(list(Path(folder).iterdir())) < 4:  # all four running before the wait that outruns the limit
        time.sleep(0.1)
    ray.get([naps, *refs])


def test_a_timed_out_task_stops_its_ray_work_and_is_not_retried(tmp_path: Path) -> None:
    warm = tmp_path / "warm-up"  # worker processes that have imported this module: the probe starts in ~1 s
    warm.mkdir()
    ray.get([_long_sleep.remote(0, str(warm)), _starts_a_nested_sleep.remote(0, str(warm))])
    tmp_path = tmp_path / "probe"
    tmp_path.mkdir()
    # the limit leaves a loaded machine time to start the actor's own worker process before it strikes
    state, attempts = run_task_once(_outruns_its_timeout, str(tmp_path), timeout_seconds=25)

    assert state.is_failed() and attempts == 1, (state, attempts)
    with pytest.raises((WorkTimedOut, TaskRunTimeoutError)):  # whichever reached the task first
        state.result()
    # the task returned only after stopping them; the state API may lag a little behind
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 4, "the actor and the three tasks were running (each in its own worker process)"
    deadline = time.monotonic() + 30
    while left := running_pids(pids):
        assert time.monotonic() < deadline, f"Ray workers still running 30 s after the timeout: {left}"
        time.sleep(0.5)
