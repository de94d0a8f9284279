"""No request to the cloud's metadata address from the GCS paths: on an emulator, or with no credentials.

The watch runs in a network namespace of its own where 169.254.169.254 answers on the loopback and records
every request (``tests/integration/metadata_watch.py``); two controls prove that it sees what it must.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.integration


def _namespace_with_a_metadata_address() -> list[str]:
    """The command prefix of a fresh network namespace with ``lo`` up and 169.254.169.254 on it."""
    permitted = shutil.which("ip") and subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0
    if not permitted:
        message = "needs 'unshare --net' (root) and iproute2's ip"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    setup = 'ip link set lo up && ip addr add 169.254.169.254/32 dev lo && exec "$@"'
    return ["unshare", "--net", "--", "sh", "-c", setup, "watch"]


def test_a_gcs_emulator_and_missing_credentials_never_ask_the_metadata_address() -> None:
    command = [*_namespace_with_a_metadata_address(), sys.executable, "-m", "tests.integration.metadata_watch"]
    env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST")}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("/token" in r for r in seen["control_delta_rs"]), f"the recorder missed delta-rs's request: {seen}"
    assert seen["control_google_auth"], f"the recorder missed google-auth's probe: {seen}"
    assert seen["rayline_on_the_emulator"] == [], seen
    assert seen["rayline_without_credentials"] == [], seen
