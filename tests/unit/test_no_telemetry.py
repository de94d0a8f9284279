"""rayline's process defaults turn off each tool's usage telemetry, as each tool itself reads its switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rayline.config import PROCESS_DEFAULTS

pytestmark = pytest.mark.unit

# What each tool asks before it sends anything, run where no CI or test variable would turn it off by itself.
_ASK_THE_TOOLS = """
import json
from mlflow.telemetry.utils import is_telemetry_disabled
from prefect._internal.analytics.enabled import is_telemetry_enabled
from prefect.settings import get_current_settings
from ray._common.usage.usage_lib import _usage_stats_report_url, usage_stats_enabled
from urllib.parse import urlsplit
print(json.dumps({
    "ray_disabled_report_leaves_the_loopback": urlsplit(_usage_stats_report_url()).hostname != "127.0.0.1",
    "mlflow": not is_telemetry_disabled(),
    "prefect_client": is_telemetry_enabled(),
    "prefect_server": get_current_settings().server.analytics_enabled,
    "ray": usage_stats_enabled(),
}))
"""
# Variables by which the tools guess that they run in CI or under a test (and stay quiet whatever rayline sets).
_CI_GUESSES = ("CI", "PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "BUILDKITE", "JENKINS_URL")


def _ask(defaults: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in (*PROCESS_DEFAULTS, *_CI_GUESSES)}
    env.update(defaults)
    return subprocess.Popen(
        [sys.executable, "-c", _ASK_THE_TOOLS], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _answer(asked: subprocess.Popen[str]) -> dict[str, bool]:
    out, err = asked.communicate(timeout=120)
    assert asked.returncode == 0, err[-2000:]
    answer: dict[str, bool] = json.loads(out.strip().splitlines()[-1])
    return answer


def test_every_tools_telemetry_is_off_under_rayline_s_defaults_and_on_without_them() -> None:
    without = {k: v for k, v in PROCESS_DEFAULTS.items() if "TRACK" not in k and "TELEMETRY" not in k}
    # both asked at once: each is a process importing Ray, Prefect and MLflow
    off, on = (
        _ask(dict(PROCESS_DEFAULTS)),
        _ask({k: v for k, v in without.items() if "ANALYTICS" not in k and "USAGE" not in k}),
    )
    assert not any(_answer(off).values())
    on_answer = _answer(on)
    assert all(on_answer.values()), (
        f"a tool's switch is not the one its telemetry reads, or it is off by itself: {on_answer}"
    )
