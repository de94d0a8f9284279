"""Pure parts of rollout gating and monitoring: verdicts, PSI, Prometheus text."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from rayline.ray_workloads.monitoring.monitor import (
    DriftThresholds,
    PartitionDrift,
    ServingHealth,
    prometheus_text,
    psi,
    serving_health,
    shares,
)
from rayline.ray_workloads.serving.control import VersionStats
from rayline.ray_workloads.serving.rollout import GateConfig, RolloutConfig, judge

pytestmark = pytest.mark.unit

GATES = GateConfig(max_error_rate=0.01, max_p95_ratio=1.5, p95_slack_ms=10, min_agreement=0.9, min_requests=20)


def _stats(requests: int, errors: int = 0, p95: float = 20.0) -> VersionStats:
    return VersionStats(version=2, requests=requests, errors=errors, p50_ms=p95 / 2, p95_ms=p95, p99_ms=p95)


def test_a_healthy_candidate_passes() -> None:
    passed, reason = judge(_stats(100), incumbent_p95_ms=20.0, agreement=0.97, gates=GATES)
    assert passed and "100 requests" in reason and "agreement 97.0%" in reason


@pytest.mark.parametrize(
    ("stats", "agreement", "expected"),
    [
        (_stats(100, errors=5), None, "error rate 5.0% (5/100) is above 1.0%"),
        (_stats(100, p95=80.0), None, "p95 latency 80.0 ms is above 40.0 ms"),
        (_stats(100), 0.5, "agreement with the incumbent 50.0% is below 90.0%"),
        (_stats(3), None, "only 3 candidate requests in the window (need 20)"),
        (None, None, "only 0 candidate requests"),
    ],
)
def test_each_gate_fails_with_its_reason(stats: VersionStats | None, agreement: float | None, expected: str) -> None:
    passed, reason = judge(stats, incumbent_p95_ms=20.0, agreement=agreement, gates=GATES)
    assert not passed and expected in reason


@pytest.mark.parametrize("steps", [[], [10, 50], [50, 10, 100], [0, 100], [10, 10, 100], [10, 150]])
def test_steps_must_rise_to_100(steps: list[float]) -> None:
    with pytest.raises(ValidationError, match="steps must rise"):
        RolloutConfig(steps=steps, probe_uri="/tmp/x")


def test_psi_is_zero_for_equal_shares_and_grows_with_shift() -> None:
    reference = shares({"0": 50, "1": 50})
    assert psi(reference, shares({"0": 50, "1": 50})) == pytest.approx(0.0)
    assert 0.0 < psi(reference, shares({"0": 60, "1": 40})) < 0.1
    assert psi(reference, shares({"0": 100})) > 0.2  # a class disappearing is a large shift, but finite


def test_prometheus_text_has_bounded_labels_and_escapes_values() -> None:
    drift = PartitionDrift(
        model_name="photos",
        dt="2026-11-28",
        version=4,
        model='v3 "tuned" \\ new',  # a registry description: any text
        inputs=10,
        predictions=9,
        errors=1,
        class_share={"0": 1.0},
        reference_share={"0": 0.5, "1": 0.5},
        psi=0.5,
        mean_confidence=0.4,
        low_confidence_share=0.6,
        drifted=True,
        reasons=["x"],
    )
    text = prometheus_text(None, [drift], model="photos")
    assert "# TYPE rayline_predictions_class_psi gauge" in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (psi_sample,) = families["rayline_predictions_class_psi"].samples
    assert psi_sample.labels == {
        "model": "photos",
        "stage": "batch_inference",
        "model_version": 'v3 "tuned" \\ new',
        "night": "0",
    }, "no per-run or per-date label: each run replaces the same series"
    assert psi_sample.value == 0.5
    assert families["rayline_predictions_error_fraction"].samples[0].value == pytest.approx(0.1)
    (stamp,) = families["rayline_predictions_night_timestamp_seconds"].samples
    assert stamp.value == datetime(2026, 11, 28, tzinfo=UTC).timestamp()


def test_prometheus_serving_counters_are_counters() -> None:
    health = ServingHealth.model_validate(
        {
            "url": "http://x",
            "reachable": True,
            "healthy": True,
            "versions": [
                {"version": 2, "weight": 100.0, "requests": 7, "errors": 1, "error_rate": 0.14, "p95_ms": 3.0}
            ],
        }
    )
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(health, [], model="digits"))}
    assert families["rayline_serve_requests"].type == "counter"
    (sample,) = families["rayline_serve_requests"].samples
    assert sample.name == "rayline_serve_requests_total" and sample.value == 7
    assert sample.labels == {"model": "digits", "stage": "serve", "model_version": "2"}


def test_one_rollout_lease_per_model(local_storage: str) -> None:
    """The lease a rollout holds (``leases.held`` in tasks/rollouts.py) is one file per model."""
    from rayline.models import registry
    from rayline.storage import leases

    def take(model: str, holder: str, ttl_s: float = 60) -> leases.Lease | None:
        return leases.try_acquire(registry.rollout_lease_uri(model), holder, ttl_s)

    first = take("digits", "run-a")
    assert first is not None and take("digits", "run-b") is None, "held by run-a"
    assert take("other-model", "run-b") is not None, "per model"
    assert leases.release(first)
    stale = take("digits", "run-b", ttl_s=-1)  # expires at once: as if it crashed
    assert stale is not None and take("digits", "run-c") is not None, "a stale lease is taken over"
    assert not leases.release(stale), "a lease taken over is not its old holder's to release"


def test_smoothed_psi_stays_sensible_with_a_thousand_mostly_empty_classes() -> None:
    from rayline.ray_workloads.monitoring.monitor import smoothed_psi

    night = {f"class-{i}": 1 for i in range(20)}  # 20 photos, 20 different ImageNet classes
    assert smoothed_psi(night, night, 0.5) == pytest.approx(0.0)
    # the same night seen again with a few classes swapped is a small change, not a ~0.3 jump per class
    shifted = {**{f"class-{i}": 1 for i in range(17)}, "class-900": 1, "class-901": 1, "class-902": 1}
    assert 0.0 < smoothed_psi(night, shifted, 0.5) < psi(shares(night), shares(shifted))
    # everything predicted as something else is a large shift
    elsewhere = {f"class-{i}": 1 for i in range(500, 520)}
    assert smoothed_psi(night, elsewhere, 0.5) > 0.2
    assert smoothed_psi({}, {}, 0.5) == 0.0


def test_leftover_shares_are_the_traffic_off_the_champion() -> None:
    from rayline.ray_workloads.serving.canary import leftover_shares

    assert leftover_shares({1: 0.0, 2: 100.0}, champion=1) == {2: 100.0}, "killed at 100 %"
    assert leftover_shares({1: 0.25, 2: 0.75}, champion=1) == {2: 75.0}, "relative weights, as %"
    assert leftover_shares({1: 100.0, 2: 0.0}, champion=1) == {}, "a candidate at 0 % is no leftover"
    assert leftover_shares({1: 90.0, 2: 10.0, 3: 0.0}, champion=3) == {1: 90.0, 2: 10.0}
    assert leftover_shares({}, champion=1) == {}


def test_reconciliation_says_what_it_found_and_did() -> None:
    from rayline.ray_workloads.serving.canary import Reconciliation

    text = Reconciliation(champion=1, left={2: 75.0, 3: 25.0}, removed=[3]).describe()
    assert "v2 at 75%, v3 at 25%" in text and "rolled all traffic back to the champion v1" in text, text
    assert "removed v3 from serving" in text, text


def _health(weights: dict[int, float]) -> ServingHealth:
    versions = [
        {"version": v, "weight": w, "requests": 5, "errors": 0, "error_rate": 0.0, "p95_ms": 3.0}
        for v, w in weights.items()
    ]
    return ServingHealth.model_validate({"url": "http://x", "reachable": True, "healthy": True, "versions": versions})


def test_most_traffic_off_the_champion_is_unhealthy_unless_a_rollout_runs() -> None:
    from rayline.ray_workloads.serving.champion import check_champion

    left = check_champion(_health({1: 0.0, 2: 100.0}), champion=1, rollout_holder=None)
    assert not left.healthy and left.champion_mismatch and left.champion == 1
    assert "v2 has the most traffic (100%) but the registry's champion is v1" in str(left.problem), left.problem
    soaking = check_champion(_health({1: 0.0, 2: 100.0}), champion=1, rollout_holder="flow run x")
    assert soaking.healthy and not soaking.champion_mismatch, "a rollout's 100 % step is no fault"
    assert check_champion(_health({1: 90.0, 2: 10.0}), champion=1, rollout_holder=None).healthy
    assert check_champion(_health({1: 50.0, 2: 50.0}), champion=1, rollout_holder=None).healthy, "a tie"
    assert check_champion(_health({2: 100.0}), champion=None, rollout_holder=None).healthy, "no champion to check"

    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(left, [], model="digits"))}
    (gauge,) = families["rayline_serve_champion_mismatch"].samples
    assert gauge.value == 1.0 and gauge.labels == {"model": "digits", "stage": "serve"}
    ok = prometheus_text(check_champion(_health({1: 100.0}), 1, None), [], model="digits")
    (gauge,) = {f.name: f for f in text_string_to_metric_families(ok)}["rayline_serve_champion_mismatch"].samples
    assert gauge.value == 0.0


class _RateLimitedRouter(BaseHTTPRequestHandler):
    """A router whose ``/stats`` budget another client at the monitor's address has spent."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.endswith("/stats"):
            status, body, headers = 429, {"error": "TooManyRequests", "detail": "slow down"}, {"Retry-After": "1"}
        else:
            status, headers = 200, {}
            body = {"status": "ok", "model": "digits", "live_versions": [1], "weights": {"1": 100.0}}
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {**headers, "Content-Type": "application/json", "Content-Length": str(len(data))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass


@pytest.fixture
def rate_limited_router() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RateLimitedRouter)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_rate_limited_stats_read_is_no_data_not_an_unhealthy_router(rate_limited_router: str) -> None:
    health = serving_health(rate_limited_router, DriftThresholds(), "digits")
    assert health.reachable and health.healthy, health
    assert health.versions == [] and "429" in str(health.stats_problem), health
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(health, [], model="digits"))}
    (up,) = families["rayline_serve_up"].samples
    assert up.value == 1.0, "judged by /healthz: a version takes traffic"
    assert families["rayline_serve_requests"].samples == [], "no per-version figures rather than made-up ones"
