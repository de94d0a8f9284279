from __future__ import annotations

import pytest

from deployments.catalog import build_deployments

pytestmark = pytest.mark.unit


def test_every_deployment_builds_with_its_schedule() -> None:
    built = {d.name: d for d in build_deployments()}
    assert set(built) >= {"nightly-inference", "prepare-data", "train-model"}
    (schedule,) = built["nightly-inference"].schedules
    assert schedule.schedule.cron == "0 2 * * *"
    assert schedule.schedule.timezone == "UTC"
    assert not built["train-model"].schedules
