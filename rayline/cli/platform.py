"""``rayline up`` / ``rayline down``: the operated system on one machine.

``up`` starts four services on loopback, each in its own session with a PID file under the state folder:
a Prefect server (``prefect``), a Ray head (``ray``), an MLflow server unless ``MLFLOW_TRACKING_URI`` names
one (``mlflow``), and a worker polling the work pool of every deployment (``worker``, ``rayline.cli.work_pool``).
``down`` stops exactly those process groups, only while each record's identity still holds
(``rayline.cli.service_records``); ``up`` twice starts nothing new, and a failed ``up`` stops what it started.
Prefect's and MLflow's tables are in SQLite under the state folder, or on the PostgreSQL server of
``RAYLINE_DATABASE_URL`` (``rayline.cli.platform_database``), checked before anything starts.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rayline import storage
from rayline.cli import work_pool
from rayline.cli.interrupts import interruptible, uninterrupted
from rayline.cli.platform_database import (
    DATABASE_URL_VARIABLE,
    PREFECT_DATABASE_VARIABLE,
    PlatformDatabases,
    checked_databases,
    mlflow_sqlite,
    prefect_sqlite,
)
from rayline.cli.service_records import SERVICES, ServiceRecord, leader_runs, pid_file, read_records, state_lock, stop
from rayline.cli.service_starts import (
    Readiness,
    Started,
    free_ports,
    http_ok,
    port_open,
    readiness,
    start_service,
    until,
    wait_ready,
)
from rayline.config import Settings, get_settings
from rayline.errors import ConfigError
from rayline.extras import install_hint
from rayline.ray_cluster import RAY_ENV_DEFAULTS
from rayline.storage.layout import MLFLOW_ARTIFACTS_DIR


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
    if storage.is_remote(root):
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


def _auth_headers() -> dict[str, str]:
    secret = os.environ.get("PREFECT_API_AUTH_STRING") or os.environ.get("PREFECT_SERVER_API_AUTH_STRING")
    return {"Authorization": "Basic " + base64.b64encode(secret.encode()).decode()} if secret else {}


def _service_environ() -> dict[str, str]:
    """This process's environment less the database URL (and its password): only the two servers that use it
    get it, each as its own tool's variable; the worker's flow runs and Ray's processes never see it."""
    return {k: v for k, v in os.environ.items() if k.upper() != DATABASE_URL_VARIABLE}


def _prefect_env(state: Path, settings: Settings) -> dict[str, str]:
    env = _service_environ()
    env.setdefault("PREFECT_HOME", str(state / "prefect"))
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
    return Path(tempfile.gettempdir()) / f"rayline-{hashlib.sha1(str(state).encode()).hexdigest()[:10]}"


def _ray_command(state: Path, settings: Settings) -> list[str]:
    cores = os.cpu_count() or 1
    client, node_manager, object_manager, agent, agent_grpc, runtime_env = free_ports(6)  # distinct
    return [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={settings.ray_port}",
        f"--num-cpus={max(2, round(cores * settings.ray_cpu_oversubscription))}",
        "--include-dashboard=true", f"--dashboard-host={settings.dashboard_host}",
        f"--dashboard-port={settings.dashboard_port}", f"--temp-dir={ray_temp_dir(state)}",
        # internal ports: free ones, so that up never clashes with another local cluster
        f"--ray-client-server-port={client}", f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
        # a fixed metrics port: Prometheus needs a stable target for Ray's and Serve's own metrics
        f"--metrics-export-port={settings.ray_metrics_port}", "--min-worker-port=20000", "--max-worker-port=29999",
    ]  # fmt: skip


def up(settings: Settings | None = None, timeout_s: float = 180.0) -> tuple[Endpoints, dict[str, str]]:
    """Start what is not running yet; returns the endpoints and what each service did ("started"/"running").

    If a service fails to come up (or the call is interrupted), what this call started is stopped again and its
    PID files removed; nothing else is signalled, whatever the state folder's other PID files name. Another
    ``up`` or ``down`` on the same state folder at the same time: ``PlatformBusy``.
    """
    settings = settings or get_settings()
    state = state_dir(settings)
    with interruptible(), state_lock(state, "up"):
        existing = {n: r for n, r in read_records(state).items() if r is not None and leader_runs(r)}
        started: Started = []
        try:
            return _up(settings, state, existing, started, timeout_s)
        except BaseException:  # interrupts too (Ctrl-C mid-start): stop what was started, re-raise
            for record, proc in reversed(started):
                stop(record, timeout_s=30, reap=proc.poll)
                pid_file(state, record.name).unlink(missing_ok=True)
            raise


def _up(
    settings: Settings, state: Path, existing: dict[str, ServiceRecord], started: Started, timeout_s: float
) -> tuple[Endpoints, dict[str, str]]:
    ends = endpoints(settings)
    starting = [name for name in SERVICES if name not in existing]
    # before anything starts: a taken port or a database that refuses fails `up` with nothing to undo
    _check_ports_free(settings, starting)
    databases = checked_databases(settings, starting)
    outcome = {name: "running" for name in SERVICES if name in existing}
    # Everything starts at once and is waited for afterwards: the start-ups (imports, database migrations, the
    # Ray head's processes, rendering prefect.yaml) overlap instead of adding up. Only the worker's steps need
    # another service (the Prefect server) to answer first.
    rendering = None
    if "worker" in starting:
        with uninterrupted():
            rendering = work_pool.PrefectYamlRendering(_worker_setup_env(state, settings, ends))
    try:
        waiting: dict[str, Readiness] = {}
        if "prefect" in starting:
            waiting["prefect"] = _start_prefect(settings, state, started, ends, databases, timeout_s)
        if "ray" in starting:
            waiting["ray"] = _start_ray(settings, state, started, ends, timeout_s)
        if "mlflow" in starting:
            outcome["mlflow"], mlflow_ready = _start_mlflow(settings, state, started, databases, timeout_s)
            if mlflow_ready is not None:
                waiting["mlflow"] = mlflow_ready
        if "prefect" in waiting:
            waiting.pop("prefect")()
            outcome["prefect"] = "started"
        if rendering is not None:
            waiting["worker"] = _start_worker(settings, state, started, ends, rendering, timeout_s)
        for name, ready in waiting.items():
            ready()
            outcome[name] = "started"
    finally:
        if rendering is not None:
            rendering.close()
    return ends, {name: outcome[name] for name in SERVICES}


def _check_ports_free(settings: Settings, starting: list[str]) -> None:
    if "prefect" in starting:
        check_port_free(settings.prefect_port, "the Prefect server (RAYLINE_PREFECT_PORT)")
    if "ray" in starting:
        check_port_free(settings.ray_port, "the Ray head (RAYLINE_RAY_PORT)")
        check_port_free(settings.dashboard_port, "the Ray dashboard (RAYLINE_DASHBOARD_PORT)")
        check_port_free(settings.ray_metrics_port, "Ray's metrics export (RAYLINE_RAY_METRICS_PORT)")
    if "mlflow" in starting and not os.environ.get("MLFLOW_TRACKING_URI"):
        check_port_free(settings.mlflow_port, "the MLflow server (RAYLINE_MLFLOW_PORT)")


def _start_prefect(
    settings: Settings,
    state: Path,
    started: Started,
    ends: Endpoints,
    databases: PlatformDatabases | None,
    timeout_s: float,
) -> Readiness:
    prefect = str(Path(sys.executable).parent / "prefect")
    command = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(settings.prefect_port)]
    env = _prefect_env(state, settings)
    if databases is not None:
        env[PREFECT_DATABASE_VARIABLE] = databases.prefect.prefect_url()
    else:  # a URL of Prefect's own variable wins over SQLite
        env.setdefault(PREFECT_DATABASE_VARIABLE, prefect_sqlite(state))
    record, proc = start_service(state, started, "prefect", command, env, ends.prefect_ui)
    health = f"{ends.prefect_api}/health"
    return readiness(health, lambda: http_ok(health, _auth_headers()), record, proc, timeout_s)


def _start_ray(settings: Settings, state: Path, started: Started, ends: Endpoints, timeout_s: float) -> Readiness:
    env = _service_environ()
    env.pop("RAY_ADDRESS", None)
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "5")
    for key, value in RAY_ENV_DEFAULTS.items():  # the head's own processes (Serve's controller, proxy) too
        env.setdefault(key, value)

    def start() -> tuple[ServiceRecord, subprocess.Popen[bytes], int]:
        log = state / "logs" / "ray.log"
        offset = log.stat().st_size if log.exists() else 0
        record, proc = start_service(state, started, "ray", _ray_command(state, settings), env, ends.dashboard)
        return record, proc, offset

    first = start()

    def ready() -> None:
        record, proc, offset = first
        for attempt in range(1, _RAY_HEAD_STARTS + 1):
            up = until(functools.partial(_head_started, record, offset), proc, timeout_s)
            if up or proc.poll() is None or attempt == _RAY_HEAD_STARTS:  # started, stuck, or out of starts
                break
            record, proc, offset = start()  # it exited while starting (and _until reaped it)
        wait_ready("the head saying the Ray runtime started", up, record, timeout_s)

    return ready


# `ray start --head` on a loaded machine can open its GCS port and then exit ("The current node timed out during
# startup": its raylet took over the 30 s Ray allows to register): a transient start-up failure, so started again,
# with fresh internal ports; a head is started once it says so, not when its port opens.
_RAY_HEAD_STARTS = 3
_HEAD_STARTED = b"Ray runtime started."


def _head_started(record: ServiceRecord, offset: int) -> bool:
    with open(record.log, "rb") as log:
        log.seek(offset)
        return _HEAD_STARTED in log.read()


def _worker_setup_env(state: Path, settings: Settings, ends: Endpoints) -> dict[str, str]:
    return {**_prefect_env(state, settings), "MLFLOW_TRACKING_URI": ends.mlflow_ui}


def _start_worker(
    settings: Settings,
    state: Path,
    started: Started,
    ends: Endpoints,
    rendering: work_pool.PrefectYamlRendering,
    timeout_s: float,
) -> Readiness:
    """The work pool, then its worker, then the deployments and the automation (the worker's start-up overlaps
    theirs: it polls a pool that has no deployment yet, which starts nothing)."""
    env = _worker_setup_env(state, settings, ends)
    pool = settings.work_pool
    work_pool.create_pool(pool, env)
    worker_env = work_pool.worker_env(env, ends.ray_address, ray_temp_dir(state))
    record, proc = start_service(state, started, "worker", work_pool.worker_command(pool), worker_env, ends.prefect_ui)
    work_pool.deploy_all(pool, env, state, rendering.result())
    work_pool.install_zombie_automation(ends.prefect_api, env.get("PREFECT_API_AUTH_STRING"))
    return readiness(f"a worker polling work pool {pool}", lambda: _worker_online(ends, pool), record, proc, timeout_s)


def mlflow_command(settings: Settings) -> list[str]:
    """MLflow's server on loopback, artifacts under the storage root (``--artifacts-destination``: clients upload
    through the server, so they need no storage credentials). Its backend store (runs and the registry) is in its
    environment, ``MLFLOW_BACKEND_STORE_URI``: a PostgreSQL URL's password stays off the command line."""
    root = storage.storage_root()
    artifacts = (
        storage.hadoop_uri(storage.join(root, MLFLOW_ARTIFACTS_DIR)) if storage.is_remote(root) else _local_dir(root)
    )
    return [
        sys.executable, "-m", "mlflow", "server",
        "--artifacts-destination", artifacts,
        "--host", "127.0.0.1", "--port", str(settings.mlflow_port),
        "--workers", "1",  # one user's UI and a few flow runs: one uvicorn worker serves them
    ]  # fmt: skip


def _local_dir(root: str) -> str:
    path = Path(root.removeprefix("file://")).resolve() / MLFLOW_ARTIFACTS_DIR
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _start_mlflow(
    settings: Settings, state: Path, started: Started, databases: PlatformDatabases | None, timeout_s: float
) -> tuple[str, Readiness | None]:
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "external", None  # the user's own tracking server: flow runs log there
    try:  # the full distribution: mlflow-skinny (the [mlflow] extra) has no server
        importlib.metadata.distribution("mlflow")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            f"rayline up starts an MLflow server, which is not installed: {install_hint('platform')}, "
            "or set MLFLOW_TRACKING_URI to a tracking server of your own"
        ) from exc
    (state / "mlflow").mkdir(parents=True, exist_ok=True)
    env = _service_environ()
    env["MLFLOW_BACKEND_STORE_URI"] = databases.mlflow.mlflow_uri() if databases else mlflow_sqlite(state)
    # MLflow's job runner (GenAI jobs) is not used here; without it the server starts and stops faster
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    ui = endpoints(settings).mlflow_ui
    record, proc = start_service(state, started, "mlflow", mlflow_command(settings), env, ui)
    health = f"{ui}/health"
    return "started", readiness(health, lambda: http_ok(health, {}), record, proc, timeout_s)


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
    """Stop what ``up`` started (by PID file, newest first); returns what happened to each service.

    A record whose process is not the one ``up`` started (it ended, its PID was reused, an earlier boot) is
    removed without a signal.
    """
    settings = settings or get_settings()
    state = state_dir(settings)
    with state_lock(state, "down"):
        records = read_records(state)
        outcome: dict[str, str] = {}
        for name in [name for name in reversed(SERVICES) if name in records]:
            record = records[name]
            outcome[name] = "not running (unreadable PID file)" if record is None else stop(record, timeout_s)
            pid_file(state, name).unlink(missing_ok=True)
        return outcome


def check_port_free(port: int, what: str) -> None:
    if port_open(port):
        raise ConfigError(f"port {port} for {what} is taken by another process; set it in the environment")
