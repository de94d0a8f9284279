"""nightly-inference: exactly one row per input, atomic commit, idempotent reruns, error budget."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from flows.nightly_inference import nightly_inference
from ray_workloads.batch_inference import MANIFEST, SUCCESS, read_partition
from rayline import registry, storage
from rayline.errors import ClusterError
from rayline.seed import seed_incoming, synthetic_objects
from tests.integration.helpers import POISON, CrashingPredictor, register_untrained_champion

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

DAY = "2026-11-28"


def _incoming(root: str, corrupt: int) -> tuple[str, set[str]]:
    incoming = storage.join(root, "incoming", f"dt={DAY}")
    seed_incoming(incoming, corrupt=corrupt)
    return incoming, {o.uri for o in storage.list_objects(incoming)}


def _rows(partition: str) -> tuple[list[str], list[str], Counter[str]]:
    predictions, errors = read_partition(partition)
    return (
        predictions.column("uri").to_pylist(),
        errors.column("uri").to_pylist(),
        Counter(errors.column("error_type").to_pylist()),
    )


def test_every_input_once_and_reruns_replace_the_partition(local_storage: str) -> None:
    register_untrained_champion()
    _, inputs = _incoming(local_storage, corrupt=8)
    result = nightly_inference(date=DAY, max_error_fraction=0.05)
    predicted, errored, error_types = _rows(result.partition_uri)
    assert len(predicted) + len(errored) == len(inputs) == 1797 + 2 + 8
    assert set(predicted) | set(errored) == inputs and not set(predicted) & set(errored)
    assert len(errored) == 8 and error_types == {
        "EmptyImageError": 2,
        "CorruptImageError": 2,
        "UnsupportedFormatError": 4,
    }
    assert storage.exists(storage.join(result.partition_uri, SUCCESS))
    manifest = storage.read_json(storage.join(result.partition_uri, MANIFEST))
    assert manifest["model"]["version"] == 1 and manifest["inputs"] == len(inputs)

    # a crashed run's leftovers never show: the committed partition is read by its manifest
    leftover = storage.join(result.partition_uri, "run-crashed", "predictions", "part-00000.parquet")
    storage.write_bytes_atomic(leftover, b"half a file")
    assert _rows(result.partition_uri)[0] == predicted

    again = nightly_inference(date=DAY)
    predicted_again, errored_again, _ = _rows(again.partition_uri)
    assert sorted(predicted_again) == sorted(predicted) and sorted(errored_again) == sorted(errored)
    runs = [o.key.split("/")[0] for o in storage.list_objects(again.partition_uri) if o.key.startswith("run-")]
    assert set(runs) == {f"run-{again.run_id}"}, "old and crashed runs are removed after the switch"


def test_error_budget_fails_the_flow_after_writing_errors(local_storage: str) -> None:
    register_untrained_champion()
    _incoming(local_storage, corrupt=200)  # 200 / 1999 ≈ 10%
    state = nightly_inference(date=DAY, max_error_fraction=0.05, return_state=True)
    assert state.is_failed()
    message = str(state.message) + repr(state.result(raise_on_failure=False))
    assert "200 of 1999 inputs failed (10.0%, budget 5.0%)" in message
    assert "errors" in message
    partition = storage.join(local_storage, "predictions", f"dt={DAY}")
    assert len(_rows(partition)[1]) == 200, "the errors table is written before the flow fails"
    assert nightly_inference(date=DAY, max_error_fraction=0.2, return_state=True).is_completed()


def _predictor_pids() -> list[int]:
    """Processes of this session's predictor actors (Ray titles them ray::MapWorker(...Predictor))."""
    from pathlib import Path

    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                if b"ray::" in cmdline and b"Predictor" in cmdline:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_a_killed_predictor_actor_loses_no_row(local_storage: str) -> None:
    import os
    import signal
    import threading
    import time

    from ray_workloads import batch_inference as bi

    register_untrained_champion()
    incoming, inputs = _incoming(local_storage, corrupt=4)
    version = registry.resolve("digits", "champion")
    config = bi.InferenceConfig(
        input_uri=incoming,
        output_root=storage.join(local_storage, "predictions"),
        partition=f"dt={DAY}",
        model=version,
        batch_size=16,  # many small batches: the run lasts long enough to lose an actor mid-way
        objects_per_task=64,
    )
    before = set(_predictor_pids())
    outcome: dict[str, object] = {}
    runner = threading.Thread(target=lambda: outcome.update(result=bi.run(config)))
    runner.start()
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and runner.is_alive() and time.monotonic() < deadline:
        fresh = [p for p in _predictor_pids() if p not in before]
        if fresh:
            time.sleep(1.0)  # let it take batches first
            killed = fresh[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.1)
    runner.join(timeout=300)
    assert killed is not None, "no predictor actor was seen to kill"
    result = outcome["result"]
    assert isinstance(result, bi.InferenceResult)
    predicted, errored, _ = _rows(result.partition_uri)
    assert sorted(predicted + errored) == sorted(inputs)


def test_an_input_that_kills_its_actor_every_time_fails_the_run_after_bounded_retries(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray_workloads import batch_inference as bi

    register_untrained_champion()
    incoming = storage.join(local_storage, "incoming", f"dt={DAY}")
    for key, data in [*synthetic_objects(12, 32, np.random.default_rng(0)), (f"0/{POISON}.png", b"any")]:
        storage.write_bytes_atomic(storage.join(incoming, key), data)
    monkeypatch.setattr(bi, "PredictorUDF", CrashingPredictor)
    config = bi.InferenceConfig(
        input_uri=incoming,
        output_root=storage.join(local_storage, "predictions"),
        partition=f"dt={DAY}",
        model=registry.resolve("digits", "champion"),
    )
    with pytest.raises(ClusterError, match="predictor actor died more than 3 times"):
        bi.run(config)
    assert not storage.exists(storage.join(config.output_root, config.partition, MANIFEST)), "nothing committed"
