"""The example project in docs/examples/my_project: a Prefect project with its own ``flows`` and ``tasks``
packages whose flow runs rayline's nightly flow as a subflow, in this process, as written."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rayline import storage
from rayline.seed import seed_incoming
from tests.integration.helpers import register_untrained_champion
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

DAY = "2026-11-27"
PROJECT = REPO_ROOT / "docs" / "examples" / "my_project"
USERS_PACKAGES = ("flows", "tasks")


@pytest.fixture
def users_project(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The project first on the path, as when its owner runs it from its folder; its modules gone after."""
    monkeypatch.syspath_prepend(str(PROJECT))
    yield PROJECT
    for name in [m for m in sys.modules if m.split(".")[0] in USERS_PACKAGES]:
        del sys.modules[name]


def test_a_project_with_its_own_flows_and_tasks_runs_rayline_s_nightly_flow(
    local_storage: str, users_project: Path
) -> None:
    register_untrained_champion()
    seeded = seed_incoming(storage.join(local_storage, "incoming", f"dt={DAY}"), corrupt=2)
    example = importlib.import_module("flows.nightly_report")
    counting = importlib.import_module("tasks.counting")
    rayline_flow = importlib.import_module("rayline.flows.nightly_inference")
    assert Path(example.__file__).is_relative_to(users_project)
    assert Path(counting.__file__).is_relative_to(users_project)
    assert not Path(rayline_flow.__file__).is_relative_to(users_project)

    report = example.nightly_report(DAY)

    assert report["predictions"] + report["errors"] == seeded.total
    assert report["errors"] == 2
    assert sum(v for k, v in report.items() if k not in ("predictions", "errors")) == report["predictions"]
