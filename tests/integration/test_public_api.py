"""The example in docs/examples/nightly_report.py: a user's own flow composing rayline's, run as written."""

from __future__ import annotations

import importlib.util

import pytest

from rayline import storage
from rayline.seed import seed_incoming
from tests.integration.helpers import register_untrained_champion
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

DAY = "2026-11-27"


def test_the_documented_example_flow_runs_rayline_as_a_subflow(local_storage: str) -> None:
    register_untrained_champion()
    seeded = seed_incoming(storage.join(local_storage, "incoming", f"dt={DAY}"), corrupt=2)
    spec = importlib.util.spec_from_file_location("nightly_report", REPO_ROOT / "docs/examples/nightly_report.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    report = example.nightly_report(DAY)

    assert report["predictions"] + report["errors"] == seeded.total
    assert report["errors"] == 2
    assert sum(v for k, v in report.items() if k not in ("predictions", "errors")) == report["predictions"]
