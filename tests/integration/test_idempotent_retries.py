"""A task retried by Prefect right after one of its side effects leaves exactly one of each.

Each case makes one side effect of ``register-and-gate`` raise a transient
error once, right after it happened (the version registered, the alias moved,
the event emitted, the lineage record written), and lets Prefect retry the
task with no delay. The end state must be one version, one alias move (from
the version before, not from itself), one event and one lineage record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any
from uuid import UUID

import numpy as np
import pytest
from prefect import flow
from prefect.client.orchestration import get_client

import rayline.ray_workloads.data.ingest
import rayline.tasks.ingest
import rayline.tasks.preprocess
import rayline.tasks.register
from rayline import events, lineage, ray_cluster, storage
from rayline.errors import TransientError
from rayline.flows.prepare_data import PrepareRequest, prepare_data
from rayline.models import registry, split_answers
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.data.ingest import IngestConfig, IngestResult
from rayline.ray_workloads.data.preprocess import PreprocessResult
from rayline.ray_workloads.nightly import batch_inference
from rayline.ray_workloads.training import promotion
from rayline.ray_workloads.training.evaluate import EvaluationResult
from rayline.ray_workloads.training.train import TrainResult
from rayline.seed import digit_objects, synthetic_objects
from rayline.tables.delta_tables import Night
from rayline.tables.predictions_table import night_seq
from rayline.tasks.batch_inference import batch_inference_task
from rayline.tasks.ingest import ingest_objects
from rayline.tasks.preprocess import preprocess_images
from rayline.tasks.register import register_and_gate
from tests.integration.helpers import one_stored_event, register_untrained_champion, run_task_once

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PreprocessResult]:
    """A small prepared digits set (its manifest is what a registration is judged on)."""
    root = str(tmp_path_factory.mktemp("retries") / "storage")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", root)
        raw = storage.join(root, "raw")
        for key, data in list(digit_objects(32))[:150]:
            storage.write_bytes_atomic(storage.join(raw, key), data)
        yield prepare_data(PrepareRequest(source_uri=raw, announce_retrain=False)).preprocess


def _fail_once_after(module: ModuleType, name: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``module.name`` does its work, then raises a transient error the first time only."""
    real: Callable[..., Any] = getattr(module, name)
    calls: list[str] = []

    def side_effect_then_fault(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        calls.append(name)
        if len(calls) == 1:
            raise TransientError(f"injected right after {name}")
        return result

    monkeypatch.setattr(module, name, side_effect_then_fault)
    return calls


def _calls_of(module: ModuleType, name: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``module.name`` works as before; each call is recorded."""
    real: Callable[..., Any] = getattr(module, name)
    calls: list[str] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


def _register_with_retries(name: str, prepared: PreprocessResult) -> tuple[promotion.PromotionResult, int]:
    spec = ModelSpec(num_classes=len(prepared.classes), width=8)
    weights_uri = storage.join(storage.storage_root(), "runs", name, "weights.pt")
    storage.write_bytes_atomic(weights_uri, state_dict_bytes(build_model(spec)))
    trained = TrainResult(
        run_name=name,
        run_uri=storage.join(storage.storage_root(), "runs", name),
        checkpoint_uri=weights_uri,
        weights_uri=weights_uri,
        metrics={},
        history=[],
        epochs=1,
        elapsed_s=1.0,
        samples_per_s=1.0,
        data_manifest_uri=prepared.manifest_uri,
    )
    evaluation = _right_on_every_test_image(prepared, weights_uri)
    fast = register_and_gate.with_options(retry_delay_seconds=0, retry_jitter_factor=None)

    @flow(name="register-retry-probe")
    def probe() -> tuple[promotion.PromotionResult, UUID | None]:
        cfg = promotion.PromotionConfig(
            name=name, spec=spec, trained=trained, evaluation=evaluation, promote_to=registry.CHALLENGER
        )
        state = fast(cfg, return_state=True)
        return state.result(), state.state_details.task_run_id

    result, task_run_id = probe()
    assert task_run_id is not None
    return result, asyncio.run(_run_count(task_run_id))


def _right_on_every_test_image(prepared: PreprocessResult, weights_uri: str) -> EvaluationResult:
    """An evaluation of a candidate that answered every test image right: one the gate promotes over an
    untrained champion (the retries, not the gate, are under test)."""
    test = storage.read_parquet(prepared.read_files()["test"], columns=["key", "etag", "label_index"])
    truth = test.column("label_index").to_numpy()
    answers = split_answers.answers_table(
        test.column("key").to_numpy(zero_copy_only=False),
        test.column("etag").to_numpy(zero_copy_only=False),
        truth,
        truth,
    )
    answers_uri = storage.join(storage.storage_root(), "runs", "answers-test.parquet")
    storage.write_parquet_atomic(answers_uri, answers)
    return EvaluationResult(
        split="test",
        data_manifest_uri=prepared.manifest_uri,
        weights_uri=weights_uri,
        samples=test.num_rows,
        accuracy=1.0,
        per_class=[],
        confusion=[],
        answers_uri=answers_uri,
    )


async def _run_count(task_run_id: UUID) -> int:
    async with get_client() as client:
        return (await client.read_task_run(task_run_id)).run_count


def _champion(name: str, prepared: PreprocessResult) -> registry.ModelVersion:
    spec = ModelSpec(num_classes=len(prepared.classes), width=8)
    champion = registry.register(
        name,
        state_dict_bytes(build_model(spec)),
        model_spec=spec,
        image_spec=prepared.image,
        classes=prepared.classes,
        metrics={promotion.GATE_METRIC: 0.5},
        data_content_hash=prepared.input_content_hash,
        code_version="test",
    )
    registry.set_alias(name, registry.CHAMPION, champion.version, "test")
    return champion


SIDE_EFFECTS: dict[str, tuple[ModuleType, str]] = {
    "version-registered": (registry, "register"),
    "alias-moved": (registry, "set_alias"),
    "event-emitted": (rayline.tasks.register, "emit_alias_move"),
    "lineage-written": (rayline.tasks.register, "record_lineage"),
}


@pytest.mark.parametrize("side_effect", list(SIDE_EFFECTS))
def test_register_and_gate_retried_after_a_side_effect_leaves_one_of_each(
    side_effect: str, prepared: PreprocessResult, prefect_api: str, monkeypatch: pytest.MonkeyPatch, test_started: float
) -> None:
    name = f"retry-{side_effect}"
    champion = _champion(name, prepared)
    module, function = SIDE_EFFECTS[side_effect]
    calls = _fail_once_after(module, function, monkeypatch)

    result, attempts = _register_with_retries(name, prepared)

    assert attempts == 2 and len(calls) == 2, (attempts, calls)
    assert [v.version for v in registry.list_versions(name)] == [champion.version, result.version.version]
    assert result.alias == registry.CHALLENGER and "beats champion" in result.decision.reason
    move = registry.alias_move(name, registry.CHALLENGER)
    assert move is not None and move.version == result.version.version and move.previous is None
    records = [r for r in lineage.read_records("registry") if r.outputs[0].uri == result.version.uri]
    assert len(records) == 1, records
    one_stored_event(
        prefect_api, events.ALIAS_MOVED, events.model_resource(name, result.version.version), since=test_started
    )


INGEST_SIDE_EFFECTS: dict[str, tuple[ModuleType, str]] = {
    "manifest-committed": (rayline.ray_workloads.data.ingest, "run"),
    "event-emitted": (rayline.tasks.ingest, "data_arrived"),
    "lineage-written": (rayline.tasks.ingest, "record_lineage"),
}


@pytest.mark.parametrize("side_effect", list(INGEST_SIDE_EFFECTS))
def test_ingest_retried_after_a_side_effect_announces_the_arrival_once(
    side_effect: str, prepared: PreprocessResult, prefect_api: str, monkeypatch: pytest.MonkeyPatch, test_started: float
) -> None:
    root = storage.storage_root()
    source = storage.join(root, f"arrivals-{side_effect}")
    for key, data in list(digit_objects(32))[:40]:
        storage.write_bytes_atomic(storage.join(source, key), data)
    module, function = INGEST_SIDE_EFFECTS[side_effect]
    calls = _fail_once_after(module, function, monkeypatch)
    fast = ingest_objects.with_options(retry_delay_seconds=0, retry_jitter_factor=None)

    @flow(name="ingest-retry-probe")
    def probe() -> tuple[IngestResult, UUID | None]:
        state = fast(IngestConfig(source_uri=source, output_root=storage.join(root, "datasets")), return_state=True)
        return state.result(), state.state_details.task_run_id

    result, task_run_id = probe()
    assert task_run_id is not None and asyncio.run(_run_count(task_run_id)) == 2 and len(calls) == 2, calls
    assert result.object_count == 40
    records = [r for r in lineage.read_records("ingest") if r.inputs[0].uri == result.source_uri]
    assert len(records) == 1, records
    one_stored_event(prefect_api, events.DATA_ARRIVED, f"rayline.data.{result.source_uri}", since=test_started)


def test_a_retried_ingest_that_finds_an_older_runs_dataset_announces_nothing(
    prepared: PreprocessResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dataset was committed by an earlier flow run (and announced then): a retry in a later
    run finds it "cached" but not committed by this run, so no second arrival is announced."""
    root = storage.storage_root()
    source = storage.join(root, "arrivals-older-run")
    for key, data in list(digit_objects(32))[:40]:
        storage.write_bytes_atomic(storage.join(source, key), data)
    config = IngestConfig(source_uri=source, output_root=storage.join(root, "datasets"))
    fast = ingest_objects.with_options(retry_delay_seconds=0, retry_jitter_factor=None)

    @flow(name="ingest-retry-probe")
    def probe() -> tuple[IngestResult, UUID | None]:
        state = fast(config, return_state=True)
        return state.result(), state.state_details.task_run_id

    first, _ = probe()  # the earlier run: commits and announces
    announced = _calls_of(rayline.tasks.ingest, "data_arrived", monkeypatch)  # announcements from here on
    _fail_once_after(ray_cluster, "connect", monkeypatch)  # the later run's first attempt fails early
    again, task_run_id = probe()

    assert task_run_id is not None and asyncio.run(_run_count(task_run_id)) == 2
    assert again.cached and again.committed_by == first.committed_by and first.committed_by is not None
    assert announced == [], "an older run's dataset was announced again"


def test_nightly_inference_retried_after_its_commit_returns_it_without_predicting_again(
    prepared: PreprocessResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = storage.storage_root()
    model = register_untrained_champion("retry-night")
    incoming = storage.join(root, "incoming-retry")
    for key, data in synthetic_objects(8, 32, np.random.default_rng(0)):
        storage.write_bytes_atomic(storage.join(incoming, key), data)
    config = batch_inference.InferenceConfig(input_uri=incoming, tables_root=root, dt="2026-11-28", model=model)
    calls = _fail_once_after(batch_inference, "run", monkeypatch)  # both Delta commits landed, then a fault
    predicted = _calls_of(batch_inference, "predict_and_write", monkeypatch)

    state, attempts = run_task_once(batch_inference_task, config)
    result = state.result()

    assert attempts == 2 and len(calls) == 2 and predicted == ["predict_and_write"], (attempts, calls, predicted)
    assert isinstance(result, batch_inference.InferenceResult) and result.already_committed
    assert (result.inputs, result.predictions + result.errors) == (8, 8)
    assert night_seq(result.predictions_table, Night("retry-night", "2026-11-28")) == 1, "one commit of the night"
    assert night_seq(result.errors_table, Night("retry-night", "2026-11-28")) == 1


PREPROCESS_SIDE_EFFECTS: dict[str, tuple[ModuleType, str]] = {
    "manifest-committed": (rayline.tasks.preprocess.preprocess, "run"),
    "lineage-written": (rayline.tasks.preprocess, "record_lineage"),
}


@pytest.mark.parametrize("side_effect", list(PREPROCESS_SIDE_EFFECTS))
def test_preprocess_retried_after_a_side_effect_decodes_once_and_records_once(
    side_effect: str, prepared: PreprocessResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry finds the folder its own first attempt committed: no second decode, one lineage record."""
    root = storage.storage_root()
    config = preprocess.PreprocessConfig(
        ingest_manifest_uri=prepared.input_manifest_uri, output_root=storage.join(root, f"prepared-{side_effect}")
    )
    module, function = PREPROCESS_SIDE_EFFECTS[side_effect]
    calls = _fail_once_after(module, function, monkeypatch)
    decoded = _calls_of(preprocess, "_decode_and_commit", monkeypatch)

    state, attempts = run_task_once(preprocess_images, config)
    result = state.result()

    assert attempts == 2 and len(calls) == 2 and decoded == ["_decode_and_commit"], (attempts, calls, decoded)
    assert preprocess.read_manifest(result.manifest_uri).counts == prepared.counts
    records = [r for r in lineage.read_records("preprocess") if r.outputs[0].uri == result.manifest_uri]
    assert len(records) == 1, records
