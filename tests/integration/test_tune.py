"""Ray Tune with ASHA: weak trials stop early; an interrupted search restores without rerunning finished trials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from rayline import storage
from rayline.ray_workloads.data import ingest, preprocess
from rayline.ray_workloads.training import tune
from rayline.seed import seed
from tests.support import stop_process

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

# a very wide learning-rate range: the tiny rates are clearly worse after one epoch
SPACE = tune.SearchSpace(lr=(1e-5, 1e-2), batch_size=[64], width=[16])


def _prepare(root: str) -> str:
    seed(storage.join(root, "raw"))
    ingested = ingest.run(
        ingest.IngestConfig(source_uri=storage.join(root, "raw"), output_root=storage.join(root, "in"))
    )
    prepared = preprocess.run(
        preprocess.PreprocessConfig(ingest_manifest_uri=ingested.manifest_uri, output_root=storage.join(root, "pre"))
    )
    return prepared.manifest_uri


def _finished_trials(experiment: Path) -> dict[str, int]:
    """trial dir → reported epochs, for the trials the newest experiment state records as TERMINATED.

    That state is what ``Tuner.restore`` resumes from. A trial logs its final
    result (``done`` in result.json) before Tune records it as terminated with
    that result's checkpoint; interrupted in between, restore resumes it as
    running from its previous checkpoint and repeats its last epoch (seen in
    CI: result.json said done, the state said RUNNING with the checkpoint
    before). So result.json alone does not say which trials restore skips.
    """
    states = sorted(experiment.glob("experiment_state-*.json"))
    if not states:
        return {}
    try:
        data = json.loads(states[-1].read_text())
    except (OSError, json.JSONDecodeError):  # being replaced right now: the next poll reads it
        return {}
    done = {}
    for trial_json, _ in data["trial_data"]:
        trial = json.loads(trial_json)
        if trial["status"] == "TERMINATED":
            result = experiment / trial["relative_logdir"] / "result.json"
            done[trial["relative_logdir"]] = len(result.read_text().splitlines())
    return done


def test_asha_stops_weak_trials_and_restore_skips_finished_ones(local_storage: str, tmp_path: Path) -> None:
    manifest = _prepare(local_storage)
    config = tune.TuneJobConfig(
        data_manifest_uri=manifest,
        output_root=storage.join(local_storage, "tuning"),
        experiment_name="search",
        space=SPACE,
        num_samples=4,  # 2 or more finished before the interrupt, some left for the restore
        max_epochs=3,
        max_concurrent_trials=1,
    )
    experiment = Path(storage.join(local_storage, "tuning", "search"))
    code = (
        "from rayline.ray_workloads.training import tune\n"
        f"tune.run(tune.TuneJobConfig.model_validate_json({config.model_dump_json()!r}))\n"
    )
    # a driver of its own on the session's cluster (starting a cluster of its own costs seconds): its trials
    # are its job's actors, gone with it
    env = {
        **os.environ,
        "RAYLINE_STORAGE": local_storage,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": "token",
    }
    driver = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len(_finished_trials(experiment)) < 2 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert driver.poll() is None, "the search ended before it could be interrupted"
        os.kill(driver.pid, signal.SIGINT)  # what Ctrl+C or a cancelled run does
        driver.wait(timeout=120)
    finally:
        stop_process(driver)
    finished_before = _finished_trials(experiment)
    assert 2 <= len(finished_before) < config.num_samples

    result = tune.run(config)
    assert result.restored
    assert len(result.trials) == config.num_samples
    after = _finished_trials(experiment)
    assert {name: after[name] for name in finished_before} == finished_before, "a finished trial was run again"
    epochs = [t.epochs for t in result.trials]
    assert max(epochs) == 3 and min(epochs) < 3, f"ASHA stopped no trial early: {epochs}"
    assert result.best_metrics["val_accuracy"] > 0.5
    assert result.best_config.lr >= 1e-4
