"""nightly-inference over a range: each night its own commit, a bad night fails alone, the run ends Failed."""

from __future__ import annotations

import itertools
import json
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from typer.testing import CliRunner

from rayline import storage
from rayline.cli import app
from rayline.cli.common import ExitCode
from rayline.errors import ErrorBudgetExceeded
from rayline.flows.nightly_backfill import BACKFILL_ARTIFACT
from rayline.flows.nightly_inference import NightRequest, nightly_inference
from rayline.ray_workloads.nightly.batch_inference import InferenceConfig, NightSkipped
from rayline.ray_workloads.nightly.request import BackfillResult, NightOutcome, NightShape
from rayline.seed import digit_objects
from rayline.tables.prediction_reads import read_night_pair
from tests.integration.helpers import register_untrained_champion

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

FIRST, BAD, LAST = "2026-11-26", "2026-11-27", "2026-11-28"
DIGITS_PER_NIGHT = 12
BUDGET = 0.1  # one broken object in 13 inputs (7.7%) is within it


def _seed_night(root: str, dt: str, offset: int) -> set[str]:
    """A small night of digits plus one empty object (an error row); the URIs of its inputs."""
    incoming = storage.join(root, "incoming", f"dt={dt}")
    for key, data in itertools.islice(digit_objects(32), offset, offset + DIGITS_PER_NIGHT):
        storage.write_bytes_atomic(storage.join(incoming, key), data)
    storage.write_bytes_atomic(storage.join(incoming, "0/empty.png"), b"")
    return {o.uri for o in storage.list_objects(incoming)}


def _assert_committed_once_per_input(root: str, outcome: NightOutcome, inputs: set[str]) -> None:
    assert outcome.state == "committed", outcome
    assert (outcome.inputs, outcome.predictions, outcome.errors) == (len(inputs), DIGITS_PER_NIGHT, 1)
    night = read_night_pair(root, "digits", outcome.dt)
    assert night.commit.version == outcome.predictions_version and night.errors_version == outcome.errors_version
    uris = night.predictions.column("uri").to_pylist() + night.errors.column("uri").to_pylist()
    assert sorted(uris) == sorted(inputs), "exactly one row per input"


def _artifact_rows(flow_run_id: object) -> list[dict[str, object]]:
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[BACKFILL_ARTIFACT]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    data = artifact.data
    rows: list[dict[str, object]] = json.loads(data) if isinstance(data, str) else data  # type: ignore[assignment]
    return rows


def test_a_bad_night_fails_alone_and_the_run_and_the_cli_say_so(local_storage: str) -> None:
    register_untrained_champion()
    inputs = {FIRST: _seed_night(local_storage, FIRST, 0), LAST: _seed_night(local_storage, LAST, 100)}
    # BAD has no incoming prefix at all: an outage that lost the night's arrivals

    # one night keeps its own path, through the same per-night config and budget: committed, then refused
    over = nightly_inference(
        NightRequest(date=LAST, shape=NightShape(actors=1), max_error_fraction=0.05), return_state=True
    )
    refused = over.result(raise_on_failure=False)
    assert over.is_failed() and isinstance(refused, ErrorBudgetExceeded), refused
    # the night's share against the budget, and where the committed error rows are
    lone = read_night_pair(local_storage, "digits", LAST)
    assert "1 of 13 inputs failed (7.7%, budget 5.0%); see the errors table: " in str(refused)
    assert f"version {lone.errors_version}, model_name = 'digits' AND dt = '{LAST}'" in str(refused)

    done = CliRunner().invoke(
        app,
        [
            "nightly-inference",
            *("--from", FIRST, "--to", LAST, "--max-concurrent", "2", "--actors", "1"),
            *("--max-error-fraction", str(BUDGET), "--json"),
        ],
    )
    assert done.exit_code == ExitCode.FAILED, done.output
    # the range's result, printed on NightsFailed: the last document on a stdout that CliRunner's capture
    # shares with the progress lines (a real process sends those to stderr)
    printed = "\n" + done.stdout
    result = BackfillResult.model_validate_json(printed[printed.rindex("\n{\n") :])
    outcomes = {night.dt: night for night in result.nights}
    assert list(outcomes) == [FIRST, BAD, LAST] and result.max_concurrent_nights == 2
    assert outcomes[BAD].state == "failed" and "no input objects under" in outcomes[BAD].message
    assert outcomes[BAD].predictions_version is None
    for dt in (FIRST, LAST):
        _assert_committed_once_per_input(local_storage, outcomes[dt], inputs[dt])
    last = outcomes[LAST]
    assert last.message == "replaced an earlier commit" and not outcomes[FIRST].message
    assert last.predictions_version is not None and last.predictions_version > lone.commit.version

    # the run's state and artifact, found by the flow run id its rows carry
    (flow_run_id,) = set(read_night_pair(local_storage, "digits", FIRST).predictions.column("flow_run_id").to_pylist())
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(flow_run_id)).state
    assert state is not None and state.is_failed(), state
    assert f"1 of 3 nights of digits failed ({BAD}: InputDataError: no input objects under" in str(state.message)
    rows = _artifact_rows(UUID(flow_run_id))
    assert [(row["dt"], row["state"]) for row in rows] == [(FIRST, "committed"), (BAD, "failed"), (LAST, "committed")]


def test_nights_run_at_most_max_concurrent_at_once(local_storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    from prefect import task

    from rayline.flows import nightly_backfill

    lock, running, peak, started = threading.Lock(), [0], [0], []

    @task(name="fake-night")
    def fake_night(config: InferenceConfig) -> NightSkipped:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            started.append(config.dt)
        time.sleep(1.5)  # long enough that a second night starts while the first runs, even on a busy box
        with lock:
            running[0] -= 1
        return NightSkipped(model_name=config.model.name, dt=config.dt, committed_by=None, message="fake")

    register_untrained_champion()
    monkeypatch.setattr(nightly_backfill, "batch_inference_task", fake_night)
    result = nightly_inference(NightRequest(date_from="2026-11-01", date_to="2026-11-05", max_concurrent_nights=2))
    assert isinstance(result, BackfillResult) and [n.state for n in result.nights] == ["skipped"] * 5
    assert peak[0] == 2 and sorted(started) == [n.dt for n in result.nights]

    # the default: the cluster's CPUs over one night's actors × CPUs each, at most the number of nights
    monkeypatch.setattr(nightly_backfill, "cluster_cpus_task", lambda: 2.0)
    peak[0] = 0
    result = nightly_inference(NightRequest(date_from="2026-11-01", date_to="2026-11-05", shape=NightShape(actors=2)))
    assert isinstance(result, BackfillResult) and result.max_concurrent_nights == 2 and peak[0] == 2
