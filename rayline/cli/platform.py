"""``rayline up`` / ``rayline down``: the operated system on one machine.

``up`` starts, on loopback by default, four processes and records each in a
PID file under the state folder:

* ``prefect``      a Prefect server (SQLite under the state folder, or
                   ``PREFECT_SERVER_DATABASE_CONNECTION_URL``), UI included;
* ``ray``          a Ray head node with its dashboard bound to ``RAYLINE_DASHBOARD_HOST``
                   (127.0.0.1 unless configured otherwise);
* ``mlflow``       an MLflow tracking server on 127.0.0.1 (SQLite under the state folder,
                   artifacts under ``<storage>/mlflow-artifacts``), unless
                   ``MLFLOW_TRACKING_URI`` names one already;
* ``worker``       a ``prefect worker`` polling a ``process`` work pool into which
                   every deployment of ``deployments/catalog.py`` was registered by
                   ``prefect deploy`` (schedules and event triggers), plus the
                   zombie-run automation (``rayline.cli.work_pool``).

Each runs in its own session, so ``down`` stops exactly what ``up`` started:
the process groups named in the PID files, nothing matched by name. ``up``
twice finds the live processes and starts nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from rayline import storage
from rayline.cli import work_pool
from rayline.config import Settings, get_settings
from rayline.errors import ClusterError, ConfigError
from rayline.ray_cluster import RAY_ENV_DEFAULTS

SERVICES = ("prefect", "ray", "mlflow", "worker")  # started in this order, stopped in the reverse
MLFLOW_ARTIFACTS_DIR = "mlflow-artifacts"


class ServiceRecord(BaseModel):
    name: str
    pid: int
    command: list[str]
    url: str
    log: str


@dataclass(frozen=True)
class Endpoints:
    prefect_api: str
    prefect_ui: str
    ray_address: str
    dashboard: str
    ray_metrics: str
    mlflow_ui: str


def state_dir(settings: Settings) -> Path:
    """Local folder for PID files, logs, the SQLite database and Ray's temp files."""
    if settings.state_dir:
        return Path(settings.state_dir).resolve()
    root = storage.storage_root()
    if storage.is_s3(root):
        return Path.home() / ".rayline" / "state"
    return Path(root.removeprefix("file://")).resolve() / "state"


def endpoints(settings: Settings) -> Endpoints:
    host = "127.0.0.1"
    return Endpoints(
        prefect_api=f"http://{host}:{settings.prefect_port}/api",
        prefect_ui=f"http://{host}:{settings.prefect_port}",
        ray_address=f"{host}:{settings.ray_port}",
        dashboard=f"http://{settings.dashboard_host}:{settings.dashboard_port}",
        ray_metrics=f"http://{host}:{settings.ray_metrics_port}/metrics",
        # a tracking server the user runs already (MLflow's own variable) takes the place of ours
        mlflow_ui=os.environ.get("MLFLOW_TRACKING_URI") or f"http://{host}:{settings.mlflow_port}",
    )


def _pid_file(state: Path, name: str) -> Path:
    return state / "pids" / f"{name}.json"


def _alive(record: ServiceRecord) -> bool:
    """The recorded PID still runs the recorded command (PIDs get reused)."""
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    # a console script runs as `python <script> …`: the recorded program is argv[0] or argv[1]
    return record.command[0].encode() in cmdline[:2]


def read_records(state: Path) -> dict[str, ServiceRecord]:
    found = {}
    for name in SERVICES:
        path = _pid_file(state, name)
        if path.exists():
            found[name] = ServiceRecord.model_validate_json(path.read_text())
    return found


def _start(
    state: Path, name: str, command: list[str], env: dict[str, str], url: str
) -> tuple[ServiceRecord, subprocess.Popen[bytes]]:
    log = state / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    record = ServiceRecord(name=name, pid=proc.pid, command=command, url=url, log=str(log))
    path = _pid_file(state, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record.model_dump_json())
    return record, proc


def _wait(check: str, ready: bool, record: ServiceRecord, timeout_s: float) -> None:
    if not ready:
        tail = Path(record.log).read_text(errors="replace")[-2000:] if Path(record.log).exists() else ""
        raise ClusterError(
            f"{record.name} did not come up within {timeout_s:.0f} s ({check}); log {record.log}:\n{tail}"
        )


def _http_ok(url: str, headers: dict[str, str]) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _until(predicate: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:  # it exited: its log says why
            return False
        time.sleep(0.5)
    return False


def _auth_headers() -> dict[str, str]:
    import base64

    secret = os.environ.get("PREFECT_API_AUTH_STRING") or os.environ.get("PREFECT_SERVER_API_AUTH_STRING")
    return {"Authorization": "Basic " + base64.b64encode(secret.encode()).decode()} if secret else {}


def _prefect_env(state: Path, settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PREFECT_HOME", str(state / "prefect"))
    env.setdefault("PREFECT_SERVER_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{state / 'prefect' / 'prefect.db'}")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["PREFECT_API_URL"] = endpoints(settings).prefect_api
    # the server's own client (UI settings, services) authenticates like any client
    if env.get("PREFECT_SERVER_API_AUTH_STRING"):
        env.setdefault("PREFECT_API_AUTH_STRING", env["PREFECT_SERVER_API_AUTH_STRING"])
    return env


def ray_temp_dir(state: Path) -> Path:
    """Ray's session files; short, because unix socket paths under it are limited to ~107 bytes."""
    candidate = state / "ray"
    if len(str(candidate)) <= 40:
        return candidate
    import hashlib
    import tempfile

    return Path(tempfile.gettempdir()) / f"rayline-{hashlib.sha1(str(state).encode()).hexdigest()[:10]}"


def _ray_command(state: Path, settings: Settings) -> list[str]:
    cores = os.cpu_count() or 1
    return [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={settings.ray_port}",
        f"--num-cpus={max(2, round(cores * settings.ray_cpu_oversubscription))}",
        "--include-dashboard=true", f"--dashboard-host={settings.dashboard_host}",
        f"--dashboard-port={settings.dashboard_port}", f"--temp-dir={ray_temp_dir(state)}",
        # internal ports: free ones, so that up never clashes with another local cluster
        f"--ray-client-server-port={_free_port()}", f"--node-manager-port={_free_port()}",
        f"--object-manager-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
        # a fixed metrics port: Prometheus needs a stable target for Ray's and Serve's own metrics
        f"--metrics-export-port={settings.ray_metrics_port}", "--min-worker-port=20000", "--max-worker-port=29999",
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def up(settings: Settings | None = None, timeout_s: float = 180.0) -> tuple[Endpoints, dict[str, str]]:
    """Start what is not running yet; returns the endpoints and what each service did ("started"/"running").

    If a service fails to come up, what this call started is stopped again.
    """
    settings = settings or get_settings()
    state = state_dir(settings)
    state.mkdir(parents=True, exist_ok=True)
    existing = {n: r for n, r in read_records(state).items() if _alive(r)}
    try:
        return _up(settings, state, existing, timeout_s)
    except Exception:
        for name, record in reversed(read_records(state).items()):
            if name not in existing:
                _stop(record, timeout_s=30)
                _pid_file(state, name).unlink(missing_ok=True)
        raise


def _up(
    settings: Settings, state: Path, existing: dict[str, ServiceRecord], timeout_s: float
) -> tuple[Endpoints, dict[str, str]]:
    ends = endpoints(settings)
    outcome: dict[str, str] = {}
    bin_dir = Path(sys.executable).parent

    if "prefect" in existing:
        outcome["prefect"] = "running"
    else:
        check_port_free(settings.prefect_port, "the Prefect server (RAYLINE_PREFECT_PORT)")
        command = [
            str(bin_dir / "prefect"),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(settings.prefect_port),
        ]
        record, proc = _start(state, "prefect", command, _prefect_env(state, settings), ends.prefect_ui)
        health = f"{ends.prefect_api}/health"
        _wait(health, _until(lambda: _http_ok(health, _auth_headers()), proc, timeout_s), record, timeout_s)
        outcome["prefect"] = "started"

    if "ray" in existing:
        outcome["ray"] = "running"
    else:
        check_port_free(settings.ray_port, "the Ray head (RAYLINE_RAY_PORT)")
        check_port_free(settings.dashboard_port, "the Ray dashboard (RAYLINE_DASHBOARD_PORT)")
        check_port_free(settings.ray_metrics_port, "Ray's metrics export (RAYLINE_RAY_METRICS_PORT)")
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "5")
        for key, value in RAY_ENV_DEFAULTS.items():  # the head's own processes (Serve's controller, proxy) too
            env.setdefault(key, value)
        record, proc = _start(state, "ray", _ray_command(state, settings), env, ends.dashboard)
        port = settings.ray_port
        _wait(f"port {port}", _until(lambda: _port_open(port), proc, timeout_s), record, timeout_s)
        outcome["ray"] = "started"

    outcome["mlflow"] = _up_mlflow(settings, state, existing, timeout_s)

    if "worker" in existing:
        outcome["worker"] = "running"
    else:
        env = {**_prefect_env(state, settings), "MLFLOW_TRACKING_URI": ends.mlflow_ui}
        pool = settings.work_pool
        work_pool.create_pool(pool, env)
        work_pool.deploy_all(pool, env, state)
        work_pool.install_zombie_automation(ends.prefect_api, env.get("PREFECT_API_AUTH_STRING"))
        worker_env = work_pool.worker_env(env, ends.ray_address, ray_temp_dir(state))
        record, proc = _start(state, "worker", work_pool.worker_command(pool), worker_env, ends.prefect_ui)
        ready = _until(lambda: _worker_online(ends, pool), proc, timeout_s)
        _wait(f"a worker polling work pool {pool}", ready, record, timeout_s)
        outcome["worker"] = "started"
    return ends, outcome


def mlflow_command(state: Path, settings: Settings) -> list[str]:
    """MLflow's server on loopback: runs and the registry in SQLite, artifacts under the storage root
    (``--artifacts-destination``: clients upload through the server, so they need no storage credentials)."""
    root = storage.storage_root()
    artifacts = storage.join(root, MLFLOW_ARTIFACTS_DIR) if storage.is_s3(root) else _local_dir(root)
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{state / 'mlflow' / 'mlflow.db'}",
        "--artifacts-destination", artifacts,
        "--host", "127.0.0.1", "--port", str(settings.mlflow_port),
        "--workers", "1",  # one user's UI and a few flow runs: one uvicorn worker serves them
    ]  # fmt: skip


def _local_dir(root: str) -> str:
    path = Path(root.removeprefix("file://")).resolve() / MLFLOW_ARTIFACTS_DIR
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _up_mlflow(settings: Settings, state: Path, existing: dict[str, ServiceRecord], timeout_s: float) -> str:
    if "mlflow" in existing:
        return "running"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "external"  # the user's own tracking server: flow runs log there
    check_port_free(settings.mlflow_port, "the MLflow server (RAYLINE_MLFLOW_PORT)")
    (state / "mlflow").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # MLflow's job runner (GenAI jobs) is not used here; without it the server starts and stops faster
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    ui = endpoints(settings).mlflow_ui
    record, proc = _start(state, "mlflow", mlflow_command(state, settings), env, ui)
    health = f"{ui}/health"
    _wait(health, _until(lambda: _http_ok(health, {}), proc, timeout_s), record, timeout_s)
    return "started"


def _worker_online(ends: Endpoints, pool: str) -> bool:
    request = urllib.request.Request(
        f"{ends.prefect_api}/work_pools/{urllib.parse.quote(pool)}/workers/filter",
        data=b"{}",
        headers={"Content-Type": "application/json", **_auth_headers()},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return any(w.get("status") == "ONLINE" for w in json.loads(answer.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def down(settings: Settings | None = None, timeout_s: float = 60.0) -> dict[str, str]:
    """Stop what ``up`` started (by PID file, newest first); returns what happened to each service."""
    settings = settings or get_settings()
    state = state_dir(settings)
    records = read_records(state)
    outcome: dict[str, str] = {}
    for name in reversed(SERVICES):
        record = records.get(name)
        if record is None:
            continue
        outcome[name] = _stop(record, timeout_s) if _alive(record) else "not running"
        _pid_file(state, name).unlink(missing_ok=True)
    return outcome


def _stop(record: ServiceRecord, timeout_s: float) -> str:
    """SIGTERM the service's process group, SIGKILL what is left after ``timeout_s``."""
    try:
        os.killpg(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        return "not running"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _group_alive(record.pid):
            return "stopped"
        time.sleep(0.3)
    os.killpg(record.pid, signal.SIGKILL)
    return "killed"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_port_free(port: int, what: str) -> None:
    if _port_open(port):
        raise ConfigError(f"port {port} for {what} is taken by another process; set it in the environment")
