"""The shipped dashboard and alert rules (deployments/monitoring): checked and unit-tested by promtool, and
naming only series that rayline's monitor writes (or Ray Serve's, found on a real scrape in the e2e tier)."""

from __future__ import annotations

import subprocess

import pyarrow as pa
import pytest

from rayline.ray_workloads.monitoring.monitor import DriftThresholds, PartitionDrift, ServingHealth, VersionHealth
from rayline.ray_workloads.monitoring.prometheus import prometheus_text
from rayline.ray_workloads.quality.metrics import NightQuality
from rayline.ray_workloads.quality.paired import paired_test
from rayline.ray_workloads.quality.shadow import ShadowSummary
from tests.monitoring_configs import (
    ALERT_TESTS,
    ALERTS,
    MONITORING,
    alert_queries,
    dashboard,
    dashboard_queries,
    scraped_series,
    series_in,
)
from tests.support import debian_tool

pytestmark = pytest.mark.unit


def test_the_alert_rules_pass_promtools_check_and_their_unit_tests() -> None:
    promtool = debian_tool("promtool", "prometheus")
    for args in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERT_TESTS)]):
        done = subprocess.run([promtool, *args], cwd=MONITORING, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


def _everything_the_monitor_writes() -> set[str]:
    """The series of a monitor file with every part present: serving, a night and its shadow, labelled quality,
    a paired test."""
    health = ServingHealth(url="http://router", reachable=True, healthy=True, champion=1,
                           versions=[VersionHealth(version=1, weight=1.0, requests=9, errors=0, error_rate=0,
                                                   p95_ms=3.0)])  # fmt: skip
    night = PartitionDrift(model_name="digits", dt="2026-12-01", version=3, model="v1", inputs=10, predictions=9,
                           errors=1, class_share={"0": 1.0}, reference_share={"0": 1.0}, psi=0.0,
                           mean_confidence=0.9, low_confidence_share=0.0, drifted=False, reasons=[])  # fmt: skip
    quality = NightQuality(model_name="digits", model_version=1, dt="2026-12-01", labelled=5, correct=4,
                           accuracy=0.8, ece=0.1, recall={"0": 0.8})  # fmt: skip
    rows = pa.table({"uri": ["u"], "etag": ["e"], "dt": ["2026-12-01"], "predicted_index": [0], "label_index": [0]})
    shadow = ShadowSummary(model_version=2, weights_uri="w", table="t", table_version=1, rows=9, compared=9,
                           agreement=0.9, mean_confidence=0.9, shadow_mean_confidence=0.8, class_shift=0.1)  # fmt: skip
    text = prometheus_text(health, [night], "digits", [quality], paired=paired_test(rows, rows, 1, 2),
                           thresholds=DriftThresholds(), shadows={night.dt: shadow})  # fmt: skip
    return scraped_series(text)


def test_the_alert_rules_name_only_series_the_monitor_writes() -> None:
    missing = series_in(alert_queries()) - _everything_the_monitor_writes()
    assert not missing, f"alerts.yml names series rayline does not export: {sorted(missing)}"


def test_the_dashboard_is_grafana_json_whose_rayline_queries_name_series_the_monitor_writes() -> None:
    board = dashboard()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"]), "panel ids must be unique"
    assert all(p["datasource"]["uid"] == "${datasource}" and p["targets"] for p in panels)
    names = series_in(dashboard_queries())
    missing = {n for n in names if n.startswith("rayline_")} - _everything_the_monitor_writes()
    assert not missing, f"the dashboard names series rayline does not export: {sorted(missing)}"
    assert {n for n in names if n.startswith("ray_serve_")}, "the dashboard shows Ray Serve's own series too"
