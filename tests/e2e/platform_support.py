"""`rayline up` for the e2e tests, and helpers to drive it: the CLI, the programs of `tests/e2e/programs`, PID
records."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from rayline.cli.platform import SERVICES, ServiceRecord, ray_temp_dir
from tests.support import REPO_ROOT, free_port

BIN = Path(sys.executable).parent
_OUTSIDE = ("RAY_ADDRESS", "PREFECT_API_URL", "AWS_ENDPOINT_URL", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_URI")
AUTH = "rayline:platform-test-secret"  # the Prefect API asks for it (PREFECT_SERVER_API_AUTH_STRING)
# The zombie automation's window (RAYLINE_ZOMBIE_WINDOW_S, 90 s by default): a killed CLI run is Crashed 30 s
# sooner. Still twice the heartbeats' 30 s, so a live run's heartbeat may be 30 s late and one a loaded machine
# delays a few seconds never crashes it.
ZOMBIE_WINDOW_S = 60


def run_rayline(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "rayline"), *args], env=env, cwd=env["RAYLINE_STORAGE"], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def run_program(
    program: ModuleType, args: list[str], env: dict[str, str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``python -m`` one of `tests/e2e/programs` in ``env``, from this checkout's root, where `tests` imports."""
    return subprocess.run(
        [sys.executable, "-m", program.__name__, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def program_output(program: ModuleType, env: dict[str, str], timeout: float = 180) -> str:
    """The stdout of a program of `tests/e2e/programs` that takes no arguments, which must succeed."""
    done = run_program(program, [], env, timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def service_records(root: Path) -> dict[str, ServiceRecord]:
    files = [root / "state" / "pids" / f"{name}.json" for name in SERVICES]
    return {f.stem: ServiceRecord.model_validate_json(f.read_text()) for f in files if f.exists()}


def processes_under(text: str) -> list[str]:
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


def platform_env(root: Path) -> dict[str, str]:
    """The environment of a `rayline up` on free loopback ports with its storage root (and state) in ``root``,
    created here: nothing of the caller's own Ray, Prefect, MLflow or rayline settings leaks in."""
    root.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in _OUTSIDE and not k.startswith("RAYLINE_")}
    env.update(
        RAYLINE_STORAGE=str(root),
        RAYLINE_PREFECT_PORT=str(free_port()),
        RAYLINE_RAY_PORT=str(free_port()),
        RAYLINE_DASHBOARD_PORT=str(free_port()),
        RAYLINE_RAY_METRICS_PORT=str(free_port()),
        RAYLINE_MLFLOW_PORT=str(free_port()),
        RAYLINE_SERVE_PORT=str(free_port()),
        PREFECT_SERVER_API_AUTH_STRING=AUTH,
        # the worker looks for flow runs to start every 2 s (10 s by default): each run a test starts through a
        # deployment waits that much less for it
        PREFECT_WORKER_QUERY_SECONDS="2",
        RAYLINE_ZOMBIE_WINDOW_S=str(ZOMBIE_WINDOW_S),
        # the demo's 450 labels would otherwise start the retrain deployment's fine-tune on them and a rollout
        # of its winner behind the later tests (docs/demo.md); that trigger's own tests: test_deployments.py,
        # tests/integration/test_label_loop.py
        RAYLINE_RETRAIN_MIN_NEW_LABELS="100000",
        # each version's first actor or replica would convert it to OpenVINO and ONNX Runtime (tens of seconds on
        # 2 cores, every version the platform's tests make): tests/unit/test_execution_plan.py and
        # test_onnx_plan.py cover those backends, as tests/conftest.py says for the other tiers
        RAYLINE_PLAN_OPENVINO="0",
        RAYLINE_PLAN_ONNXRUNTIME="0",
    )
    return env


def up_env(platform: dict[str, str]) -> dict[str, str]:
    """The environment the platform's `up` ran in: the platform's, less what a user exports to work against it
    (with ``MLFLOW_TRACKING_URI`` set, `up` would take that server for one of the user's own and start none)."""
    return {k: v for k, v in platform.items() if k not in (*_OUTSIDE, "RAY_AUTH_MODE")}


def password_shown(root: Path, database_url: str, *outputs: str) -> list[str]:
    """Where the password of ``database_url`` shows: in ``outputs``, a PID file, a service's log or command line."""
    password = urllib.parse.unquote(urllib.parse.urlsplit(database_url).password or "")
    assert password, "a URL with a password"
    state = root / "state"
    places = [f"output {i}" for i, text in enumerate(outputs) if password in text]
    files = [*state.glob("pids/*.json"), *state.glob("logs/*.log")]
    places += [str(f) for f in files if password.encode() in f.read_bytes()]
    for name, record in service_records(root).items():
        with contextlib.suppress(OSError):  # ended meanwhile
            if password.encode() in Path(f"/proc/{record.pid}/cmdline").read_bytes():
                places.append(f"{name}'s command line")
    return places


@contextlib.contextmanager
def running_platform(
    tmp_path_factory: pytest.TempPathFactory, database_url: str | None = None
) -> Iterator[dict[str, str]]:
    """`rayline up` (API basic auth on) on free loopback ports in a fresh storage root, its Prefect and MLflow
    servers on the PostgreSQL of ``database_url`` (RAYLINE_DATABASE_URL) when given; `down` after, by PID.

    Yields the environment a user exports to work against it (docs/operations.md).
    """
    root = tmp_path_factory.mktemp("platform") / "data"
    env = platform_env(root)
    if database_url is not None:
        env["RAYLINE_DATABASE_URL"] = database_url
    try:
        started = run_rayline(["up"], env)  # in the try: an `up` that timed out leaves services for `down`
        assert started.returncode == 0, started.stdout + started.stderr
        assert all(f"{name:<12} started" in started.stdout for name in SERVICES), started.stdout
        if database_url is not None:
            assert password_shown(root, database_url, started.stdout, started.stderr) == []
        yield {
            **env,
            "PREFECT_API_URL": f"http://127.0.0.1:{env['RAYLINE_PREFECT_PORT']}/api",
            "PREFECT_API_AUTH_STRING": AUTH,
            "RAY_ADDRESS": f"127.0.0.1:{env['RAYLINE_RAY_PORT']}",
            "RAY_AUTH_MODE": "token",
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{env['RAYLINE_MLFLOW_PORT']}",
        }
    finally:
        started_services = service_records(root)
        stopped = run_rayline(["down"], env)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        marks = [str(root), str(ray_temp_dir(root / "state"))]
        deadline = time.monotonic() + 30
        while any(processes_under(m) for m in marks) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [p for m in marks for p in processes_under(m)] == [], "processes of `rayline up` survived `down`"
        assert not any(Path(f"/proc/{r.pid}").exists() for r in started_services.values())
