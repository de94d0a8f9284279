"""nightly-inference: exactly one row per input, one Delta commit per table, reruns replace the night."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import numpy as np
import pytest
from deltalake import DeltaTable

from rayline import storage
from rayline.errors import OutOfMemory, RetriesExhausted, is_transient
from rayline.flows.nightly_inference import NightRequest, nightly_inference
from rayline.models import registry
from rayline.ray_workloads.execution.ahead import measure_ahead
from rayline.ray_workloads.execution.cache import cached_plan, plan_for, plan_uri
from rayline.ray_workloads.execution.interface import load_version
from rayline.ray_workloads.execution.plan import REFERENCE, Plan, PlanPolicy, softmax, torch_run
from rayline.ray_workloads.nightly.batch_inference import InferenceResult, NightSkipped
from rayline.ray_workloads.nightly.holding import night_lease_uri
from rayline.ray_workloads.nightly.request import NightShape
from rayline.seed import digit_objects, seed_incoming, synthetic_objects
from rayline.storage import leases
from rayline.tables.delta_tables import Night
from rayline.tables.prediction_reads import committed_nights, read_night_pair
from tests.fp16_overflow import BRIGHT_PEAK, DIM_PEAK, decoded, digit_pngs, register_overflowing
from tests.integration.helpers import (
    POISON,
    CrashingPredictor,
    LeaseWaiters,
    OutOfMemoryPredictor,
    register_untrained_champion,
    run_task_once,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

DAY = "2026-11-28"


def _incoming(root: str, corrupt: int) -> tuple[str, set[str]]:
    incoming = storage.join(root, "incoming", f"dt={DAY}")
    seed_incoming(incoming, corrupt=corrupt)
    return incoming, {o.uri for o in storage.list_objects(incoming)}


def _rows(root: str, model: str = "digits") -> tuple[list[str], list[str], Counter[str]]:
    night = read_night_pair(root, model, DAY)
    predictions, errors = night.predictions, night.errors
    return (
        predictions.column("uri").to_pylist(),
        errors.column("uri").to_pylist(),
        Counter(errors.column("error_type").to_pylist()),
    )


def test_every_input_once_and_reruns_replace_the_partition(local_storage: str) -> None:
    version = register_untrained_champion()
    _, inputs = _incoming(local_storage, corrupt=8)
    # the plan measured where the version is made (a pin: measured on any CPU), on a night actor's CPUs; its
    # first night adopts it (the marker the test writes into the cached plan is the night's reason)
    pinned = PlanPolicy(precision="bf16")
    ahead = measure_ahead(version, pinned, cpus=NightShape().cpus_per_actor)
    assert ahead is not None and ahead.key, ahead
    cached_uri = plan_uri(version.uri, ahead.key)
    record = json.loads(storage.read_bytes(cached_uri))
    storage.write_bytes_atomic(cached_uri, json.dumps({**record, "reason": "measured ahead"}).encode())
    result = nightly_inference(NightRequest(date=DAY, max_error_fraction=0.05, plan=pinned))
    assert isinstance(result, InferenceResult)
    assert [p["reason"] for p in result.plans.values()] == ["measured ahead"], result.plans
    predicted, errored, error_types = _rows(local_storage)
    assert len(predicted) + len(errored) == len(inputs) == 1797 + 2 + 8
    assert set(predicted) | set(errored) == inputs and not set(predicted) & set(errored)
    assert len(errored) == 8 and error_types == {
        "EmptyImageError": 2,
        "CorruptImageError": 2,
        "UnsupportedFormatError": 4,
    }
    # one commit per table: the table and the night's columns as a plain Delta reader sees them
    table = DeltaTable(result.predictions_table)
    assert table.version() == result.predictions_version and not result.replaced
    assert table.metadata().partition_columns == ["model_name", "dt"]
    rows = table.to_pyarrow_table(partitions=[("model_name", "=", "digits"), ("dt", "=", DAY)])
    assert set(rows.column("model_version").to_pylist()) == {1} and rows.num_rows == len(predicted)
    assert DeltaTable(result.errors_table).version() == result.errors_version
    assert committed_nights(local_storage, "digits") == [DAY]
    # what the night cost: its actors' and driver's CPU, never more than the machine's cores gave it meanwhile
    cores = os.cpu_count() or 1
    assert result.core_seconds is not None and 0 < result.core_seconds <= result.elapsed_s * cores * 1.05 + 1
    assert result.images_per_core_second == round(result.inputs / result.core_seconds, 3)
    assert table.history(1)[0]["rayline.core_seconds"] == result.core_seconds, "in the commit's info too"

    # a crashed run's leftovers never show: readers go by the Delta log, not the folder
    night_folder = storage.join(result.predictions_table, "model_name=digits", f"dt={DAY}")
    storage.write_bytes_atomic(storage.join(night_folder, "part-crashed-0.parquet"), b"half a file")
    assert _rows(local_storage)[0] == predicted

    again = nightly_inference(NightRequest(date=DAY))
    assert isinstance(again, InferenceResult) and again.replaced
    assert again.predictions_version == result.predictions_version + 1, "one commit per run"
    predicted_again, errored_again, _ = _rows(local_storage)
    assert sorted(predicted_again) == sorted(predicted) and sorted(errored_again) == sorted(errored)
    # the first run stays readable by version number (time travel) until a vacuum
    first = DeltaTable(result.predictions_table, version=result.predictions_version).to_pyarrow_table()
    assert sorted(first.column("uri").to_pylist()) == sorted(predicted)


def test_three_runs_of_one_night_started_together_all_end_completed(local_storage: str) -> None:
    """One predicts the night; the others wait on its lease and find it committed; one row per input."""
    from concurrent.futures import ThreadPoolExecutor

    register_untrained_champion()
    incoming = storage.join(local_storage, "incoming", f"dt={DAY}")
    for key, data in list(digit_objects(32))[:24]:
        storage.write_bytes_atomic(storage.join(incoming, key), data)
    inputs = {o.uri for o in storage.list_objects(incoming)}
    # "together" made sure of: the test holds the night's lease until all three runs wait on it. Left to the
    # scheduler, a run that starts after the first one committed is a rerun, which rightly replaces the night.
    lease_uri = night_lease_uri(local_storage, Night("digits", DAY))
    with LeaseWaiters() as waiters, ThreadPoolExecutor(3) as pool:
        with leases.held(lease_uri, "the-test", ttl_s=300, wait_s=0):
            runs = [
                pool.submit(nightly_inference, NightRequest(date=DAY, shape=NightShape(actors=1)), return_state=True)
                for _ in range(3)
            ]
            waiters.wait_for(3, timeout_s=240)
        states = [run.result() for run in runs]
    assert all(state.is_completed() for state in states), [state.message for state in states]
    results = [state.result() for state in states]
    committed = {r.run_id for r in results if isinstance(r, InferenceResult)}
    skipped = [r for r in results if isinstance(r, NightSkipped)]
    # the night's lease: one run predicts and commits, the others wait for it and find the night committed
    assert len(committed) == 1 and len(skipped) == 2, results
    losers: set[str] = set()
    for loser in skipped:
        assert "another run committed that night" in loser.message and loser.committed_by in committed, loser
        # who committed, and which run's files stay uncommitted: the loser's own
        assert f"{loser.committed_by} committed digits {DAY}" in loser.message, loser
        named = re.search(r"after run (\S+) read it .*; \1's files stay uncommitted", loser.message)
        assert named is not None and named.group(1) not in committed, loser
        losers.add(named.group(1))
    assert len(losers) == 2, losers
    predicted, errored, _ = _rows(local_storage)
    assert sorted(predicted + errored) == sorted(inputs), "exactly one row per input"
    assert read_night_pair(local_storage, "digits", DAY).commit.run_id in committed


def test_an_input_that_kills_its_actor_every_time_fails_the_run_after_bounded_retries(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rayline.ray_workloads.nightly import batch_inference as bi

    register_untrained_champion()
    incoming = storage.join(local_storage, "incoming", f"dt={DAY}")
    for key, data in [*synthetic_objects(12, 32, np.random.default_rng(0)), (f"0/{POISON}.png", b"any")]:
        storage.write_bytes_atomic(storage.join(incoming, key), data)
    monkeypatch.setattr(bi, "PredictorUDF", CrashingPredictor)
    config = bi.InferenceConfig(
        input_uri=incoming,
        tables_root=local_storage,
        dt=DAY,
        model=registry.resolve("digits", "champion"),
    )
    from rayline.tasks.batch_inference import batch_inference_task

    # Ray Data restarted the actor and retried the block 3 times: Prefect runs the task once
    state, attempts = run_task_once(batch_inference_task, config)
    with pytest.raises(RetriesExhausted, match="failed in all 4 attempt") as failed:
        state.result()
    assert attempts == 1 and not is_transient(failed.value)
    assert committed_nights(local_storage, "digits") == [], "nothing committed"


def test_a_model_call_out_of_memory_fails_the_night_once_and_commits_nothing(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory is the machine's fault, not the samples': no "predict" error rows, and no retry of the same shape."""
    from rayline.ray_workloads.nightly import batch_inference as bi
    from rayline.tasks.batch_inference import batch_inference_task

    register_untrained_champion()
    incoming = storage.join(local_storage, "incoming", f"dt={DAY}")
    for key, data in synthetic_objects(12, 32, np.random.default_rng(0)):
        storage.write_bytes_atomic(storage.join(incoming, key), data)
    monkeypatch.setattr(bi, "PredictorUDF", OutOfMemoryPredictor)
    config = bi.InferenceConfig(
        input_uri=incoming, tables_root=local_storage, dt=DAY, model=registry.resolve("digits", "champion")
    )
    state, attempts = run_task_once(batch_inference_task, config)
    with pytest.raises(OutOfMemory, match="CUDA out of memory") as failed:
        state.result()
    assert attempts == 1 and not is_transient(failed.value)
    assert committed_nights(local_storage, "digits") == [], "nothing committed"


def test_a_night_whose_fp16_plan_overflows_on_some_images_writes_fp32s_rows_for_them_and_demotes_the_plan(
    local_storage: str,
) -> None:
    """An fp16 plan an earlier night cached on dim images meets bright ones (tests/fp16_overflow.py): their
    batches are predicted again in fp32, the night counts them, and the next night runs fp32."""
    version = register_overflowing("overflow")
    incoming = storage.join(local_storage, "incoming", "overflow", f"dt={DAY}")
    bright, dim = digit_pngs(range(8), BRIGHT_PEAK), digit_pngs(range(8, 32), DIM_PEAK)  # listed dim first
    for key, data in bright + dim:
        storage.write_bytes_atomic(storage.join(incoming, key), data)
    fp16 = Plan(precision="fp16")
    loaded = load_version(version, device="cpu")
    cached = plan_for(loaded, version.uri, decoded(dim[:8]), PlanPolicy(precision="fp16"))
    assert cached.plan == fp16 and cached.key is not None, cached.reason

    shape, plan = NightShape(actors=1, batch_size=4), PlanPolicy(precision="fp16")
    result = nightly_inference(
        NightRequest(date=DAY, model_name="overflow", input_uri=incoming, shape=shape, plan=plan)
    )
    assert isinstance(result, InferenceResult) and (result.predictions, result.errors) == (32, 0)
    night = read_night_pair(local_storage, "overflow", DAY)
    rows = {r["uri"]: r for r in night.predictions.to_pylist()}
    assert {r["plan"] for r in rows.values()} == {fp16.name}
    assert loaded.module is not None
    fp32 = torch_run(loaded.module, REFERENCE)
    for (key, _), probabilities in zip(bright, softmax(fp32(decoded(bright))), strict=True):  # fp32's rows
        row, top = rows[storage.join(incoming, key)], np.argsort(-probabilities, kind="stable")[:3]
        assert row["top_k_index"] == top.tolist(), key
        assert row["top_k_prob"] == pytest.approx(probabilities[top].tolist(), abs=1e-6), key
    for (key, _), probabilities in zip(dim, softmax(fp32(decoded(dim))), strict=True):  # fp16's, within the gate
        row = rows[storage.join(incoming, key)]
        assert (row["predicted_index"], row["confidence"]) == (
            probabilities.argmax(),
            pytest.approx(probabilities.max(), abs=0.05),
        ), key

    # 8 batches of 4, the bright images in the last 2: over 1 % of the night's batches, so fp32 from the next night
    use = {"batches": 8, "fallback_batches": 2, "fallback_images": 8}
    demoted = f"fp32 eager: eager/fp16/channels-last demoted on the night overflow dt={DAY}, 2 of 8 batches"
    assert {k: result.plans[fp16.name][k] for k in use} == use
    reason = result.plans[fp16.name]["demoted"]
    assert reason.startswith(demoted)
    assert json.loads(night.commit.to_metadata()["rayline.plan_use"])[fp16.name] == {**use, "demoted": reason}
    again = cached_plan(plan_uri(version.uri, cached.key))
    assert again is not None and (again.plan, again.reason) == (REFERENCE, reason)
