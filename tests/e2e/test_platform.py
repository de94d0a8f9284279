"""`rayline up` / `rayline down` on loopback, and event-driven retraining against the real Prefect server it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rayline.platform import SERVICES, ServiceRecord, ray_temp_dir
from tests.support import free_port

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
_OUTSIDE = ("RAY_ADDRESS", "PREFECT_API_URL", "AWS_ENDPOINT_URL")


def _rayline(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "rayline"), *args], env=env, cwd=env["RAYLINE_STORAGE"], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _records(root: Path) -> dict[str, ServiceRecord]:
    files = [root / "state" / "pids" / f"{name}.json" for name in SERVICES]
    return {f.stem: ServiceRecord.model_validate_json(f.read_text()) for f in files if f.exists()}


def _processes_under(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline[:120]}")
    return found


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`rayline up` on free loopback ports in a fresh storage root; `rayline down` after, checked by PID."""
    root = tmp_path_factory.mktemp("platform") / "data"
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _OUTSIDE and not k.startswith("RAYLINE_")}
    env.update(
        RAYLINE_STORAGE=str(root),
        RAYLINE_PREFECT_PORT=str(free_port()),
        RAYLINE_RAY_PORT=str(free_port()),
        RAYLINE_DASHBOARD_PORT=str(free_port()),
        RAYLINE_SERVE_PORT=str(free_port()),
    )
    started = _rayline(["up"], env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert all(f"{name:<12} started" in started.stdout for name in SERVICES), started.stdout
        yield {**env, "PREFECT_API_URL": f"http://127.0.0.1:{env['RAYLINE_PREFECT_PORT']}/api"}
    finally:
        records = _records(root)
        stopped = _rayline(["down"], env)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        marks = [str(root), str(ray_temp_dir(root / "state"))]
        deadline = time.monotonic() + 30
        while any(_processes_under(m) for m in marks) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [p for m in marks for p in _processes_under(m)] == [], "processes of `rayline up` survived `down`"
        assert not any(Path(f"/proc/{r.pid}").exists() for r in records.values())


def test_up_twice_starts_nothing_new(platform: dict[str, str]) -> None:
    root = Path(platform["RAYLINE_STORAGE"])
    before = _records(root)
    again = _rayline(["up"], platform)
    assert again.returncode == 0, again.stderr
    assert all(f"{name:<12} running" in again.stdout for name in SERVICES), again.stdout
    assert _records(root) == before
    assert f"Prefect UI       http://127.0.0.1:{platform['RAYLINE_PREFECT_PORT']}" in again.stdout


EMIT_AND_COUNT = textwrap.dedent(
    """
    import asyncio, sys, time
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.events import emit_event

    def arrival(prefix, eligible):
        emit_event(event="rayline.data.arrived", payload={"source_uri": prefix, "new_labelled": 500},
                   resource={"prefect.resource.id": f"rayline.data.{prefix}", "rayline.retrain": eligible})

    async def retrain_runs():
        async with get_client() as client:
            found = await client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["retrain"])))
        return len(found)

    arrival("s3://bucket/small", "false")   # below the threshold: no run
    time.sleep(3)
    print("below", asyncio.run(retrain_runs()))
    for _ in range(5):                        # a burst above it: one run
        arrival("s3://bucket/raw", "true")
    deadline = time.monotonic() + 60
    while asyncio.run(retrain_runs()) == 0 and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(5)                             # would a second run appear?
    print("burst", asyncio.run(retrain_runs()))
    """
)


def test_a_burst_of_labelled_arrivals_starts_exactly_one_retraining(platform: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EMIT_AND_COUNT], env=platform, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "below 0" in done.stdout and "burst 1" in done.stdout, done.stdout
