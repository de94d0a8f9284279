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


def _telemetry_on(defaults: dict[str, str]) -> dict[str, bool]:
    env = {k: v for k, v in os.environ.items() if k not in (*PROCESS_DEFAULTS, *_CI_GUESSES)}
    env.update(defaults)
    done = subprocess.run([sys.executable, "-c", _ASK_THE_TOOLS], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    answer: dict[str, bool] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def test_every_tools_telemetry_is_off_under_rayline_s_defaults_and_on_without_them() -> None:
    assert not any(_telemetry_on(dict(PROCESS_DEFAULTS)).values())
    without = {k: v for k, v in PROCESS_DEFAULTS.items() if "TRACK" not in k and "TELEMETRY" not in k}
    on = _telemetry_on({k: v for k, v in without.items() if "ANALYTICS" not in k and "USAGE" not in k})
    assert all(on.values()), f"a tool's switch is not the one its telemetry reads, or it is off by itself: {on}"
