"""The series the shipped dashboard and alert rules name (deployments/monitoring), read from their files."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml  # type: ignore[import-untyped]  # no stubs installed; only safe_load is used

from tests.support import REPO_ROOT

MONITORING = REPO_ROOT / "deployments" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERTS = MONITORING / "alerts.yml"
ALERT_TESTS = MONITORING / "alerts.test.yml"
_SERIES = re.compile(r"\b(rayline_[a-z0-9_]+|ray_[a-z0-9_]+)\b")


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: its panels' targets and its template variables."""
    board = dashboard()
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in board["templating"]["list"] if v.get("definition")]
    return queries


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def series_in(queries: list[str]) -> set[str]:
    return {name for query in queries for name in _SERIES.findall(query)}


def scraped_series(text: str) -> set[str]:
    """The series names of a Prometheus text exposition (a histogram's ``_bucket`` and the rest as written)."""
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
