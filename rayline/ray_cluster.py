"""Lazy, idempotent connection to Ray (never at import).

* ``RAY_ADDRESS`` set: join that cluster, shipping rayline's own packages with ``runtime_env`` so its workers
  can import ``ray_workloads``.
* Unset: start an embedded local cluster with oversubscribed logical CPUs, so that Ray Data, Train and Serve
  do not starve each other on a 2-core box.

One connection per process; every Prefect task calls :func:`connect` and reuses it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rayline.config import Settings, get_settings
from rayline.errors import ClusterError, ConfigError

NAMESPACE = "rayline"
# Non-secret variables workers need to reach storage the way the driver does.
# Credentials are deliberately not forwarded: a cluster brings its own.
_FORWARDED_ENV = (
    "AWS_ENDPOINT_URL AWS_REGION AWS_DEFAULT_REGION RAYLINE_S3_ENDPOINT_URL STORAGE_EMULATOR_HOST"
    " AZURE_STORAGE_ACCOUNT_NAME RAYLINE_IO_CONCURRENCY RAYLINE_STORAGE_MAX_ATTEMPTS RAYLINE_STORAGE_TIMEOUT_S"
    " RAYLINE_STORAGE_CONNECT_TIMEOUT_S"
).split()

_lock = threading.Lock()


class TextSink(Protocol):
    """Where worker output can go: a text file, or anything written like one."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


_worker_log_stream: TextSink | None = None
_ray_print_to_stdstream: Any = None  # Ray's own print_to_stdstream, kept to put back


@dataclass(frozen=True)
class RayConnection:
    """Facts about the cluster this process is connected to (for lineage)."""

    address: str
    job_id: str
    embedded: bool
    num_cpus: float


# Ray defaults that cost seconds per run on small jobs; explicit settings win.
RAY_ENV_DEFAULTS = {
    # the Train controller notices finished/failed workers after this long (default 2 s)
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # Serve's lower-latency request path (part of RAY_SERVE_THROUGHPUT_OPTIMIZED, without its direct
    # ingress, which would drop the HTTP proxy): user code and the handle router on the replica's own
    # event loop instead of extra threads, and handle calls over gRPC rather than as Ray actor calls.
    # rayline's replicas run blocking work (decode, forward pass) in worker threads, so the loop stays free.
    # bench/serve.py: both the router path and the direct path get faster; see README, "Serving".
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    # Serve's replicas log (an access line per request on the router and on the model) to their files
    # under <session>/logs/serve/ only, not to stderr as well: there every line is written twice, tailed by
    # Ray's log monitor (a process at normal priority beside replicas at Ray's worker niceness of 15) and
    # pushed to connected drivers. Saturated serving on 2 cores: +7 % req/s, p99 81 -> 71 ms (bench/README.md).
    "RAY_SERVE_LOG_TO_STDERR": "0",
}


# The package a remote cluster's workers run, shipped by folder (Ray's zip follows the links of
# rayline/ray_workloads and the rest). Found by name, not imported: what ships is the code.
_SHIPPED_PACKAGES = ("rayline",)


def _package_folder(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"cannot ship package {name} to the cluster: it is not importable here")
    return str(list(spec.submodule_search_locations)[0])


def _remote_runtime_env() -> dict[str, Any]:
    env_vars = {k: os.environ[k] for k in _FORWARDED_ENV if os.environ.get(k)}
    env_vars.update({k: os.environ.get(k, v) for k, v in RAY_ENV_DEFAULTS.items()})
    return {"env_vars": env_vars, "py_modules": [_package_folder(name) for name in _SHIPPED_PACKAGES]}


def _preload_config(preload: Sequence[str], num_cpus: int) -> dict[str, Any]:
    """System config for workers that import ``preload`` as they start.

    Ray prestarts one worker per logical CPU, but only as many at a time as there are cores, and the rest never
    (on 2 cores, 2 of 4): a Ray Data actor pool, which wants two helper actors besides its own, would wait.
    """
    return {"preload_python_modules": list(preload), "worker_maximum_startup_concurrency": num_cpus}


def _wait_until_reachable(address: str, timeout_s: float) -> None:
    """Fail fast on an address where nothing listens: Ray's own connect retries a dead head for ~14 minutes.
    Only ``host:port`` and ``ray://host:port`` are checked; other forms (``auto``) are Ray's to resolve."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"could not connect to Ray: nothing accepted a connection at {address} (RAY_ADDRESS) within "
                    f"{timeout_s:g} s ({exc}); is the cluster up? (`rayline up` starts one; unset RAY_ADDRESS for "
                    "an embedded one)"
                ) from exc
            time.sleep(min(1.0, timeout_s))


def _start(settings: Settings, preload: Sequence[str]) -> bool:
    import ray

    if settings.ray_address:
        _wait_until_reachable(settings.ray_address, settings.ray_connect_timeout_s)
    try:
        if settings.ray_address:
            ray.init(address=settings.ray_address, namespace=NAMESPACE, runtime_env=_remote_runtime_env())
            return False
        # The embedded cluster's processes inherit this environment, so no runtime_env: with one,
        # Ray cannot hand out the workers it prestarts (their runtime env differs) and every actor
        # waits for a fresh process to start (bench/README.md).
        for key, value in RAY_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        ray.init(
            address="local",
            num_cpus=settings.embedded_num_cpus,
            namespace=NAMESPACE,
            include_dashboard=False,
            # loopback only: nothing of the embedded cluster should face the network
            _node_ip_address="127.0.0.1",
            _system_config=_preload_config(preload, settings.embedded_num_cpus) if preload else None,
        )
        return True
    except Exception as exc:  # ray.init fails in many classes (ConnectionError, RuntimeError, auth…): no cluster
        target = settings.ray_address or "an embedded local cluster"
        raise ClusterError(f"could not connect to Ray at {target}: {type(exc).__name__}: {exc}") from exc


def send_worker_logs_to(stream: TextSink | None) -> None:
    """Where Ray's output in this process goes: ``stream``, or None for Ray's default (the terminal).

    Ray prints every worker's stdout/stderr in the driver's terminal (``log_to_driver``), and so the messages
    the raylet and core workers push to the driver ("8 PYTHON worker processes have been started…"); the CLI
    keeps its terminal for rayline's own progress and puts them all in its log file instead.
    """
    global _worker_log_stream
    _worker_log_stream = stream
    _route_worker_logs()  # ray.init adds its own handler again: connect() routes once more after it


def _route_worker_logs() -> None:
    # Ray has no public option to send the driver's copy of worker output elsewhere than the terminal
    # (log_to_driver=False would drop it): swap the handler its log thread dispatches to. The messages
    # pushed to the driver bypass that dispatcher: Ray's error-listener thread calls the module's
    # print_to_stdstream itself (looked up at each call), so that function is swapped too.
    from ray._private import ray_logging, worker

    global _ray_print_to_stdstream
    if _ray_print_to_stdstream is None:
        _ray_print_to_stdstream = worker.print_to_stdstream
    dispatcher, stream = ray_logging.global_worker_stdstream_dispatcher, _worker_log_stream
    dispatcher.remove_handler("ray_print_logs")
    if stream is None:
        worker.print_to_stdstream = _ray_print_to_stdstream
        dispatcher.add_handler("ray_print_logs", functools.partial(_ray_print_to_stdstream, ignore_prefix=False))
    else:

        def to_stream(data: dict[str, Any], ignore_prefix: bool = False) -> None:
            worker.print_worker_logs(data, stream, ignore_prefix)

        worker.print_to_stdstream = to_stream
        dispatcher.add_handler("ray_print_logs", to_stream)


_embedded: bool | None = None


def connect(settings: Settings | None = None, preload: Sequence[str] = ()) -> RayConnection:
    """Connect to Ray once per process and describe the connection.

    ``preload``: modules each worker of an embedded cluster imports as it starts, so that actors that need,
    say, torch get a prestarted worker that already has it (bench/README.md). It applies only when this call
    starts the cluster, and costs every other worker the same import: pass it only where the Ray work needs it.
    """
    global _embedded
    import ray

    settings = settings or get_settings()
    with _lock:
        if not ray.is_initialized():
            _embedded = _start(settings, preload)
            if _worker_log_stream is not None:
                _route_worker_logs()
        context = ray.get_runtime_context()
        return RayConnection(
            # the address users know the cluster by; GCS may report another interface
            address=settings.ray_address if not _embedded and settings.ray_address else str(context.gcs_address),
            job_id=str(context.get_job_id()),
            embedded=bool(_embedded),
            num_cpus=float(ray.cluster_resources().get("CPU", 0.0)),  # type: ignore[no-untyped-call]
        )


def disconnect() -> None:
    """Leave the cluster (and stop it when rayline started it embedded)."""
    global _embedded
    import ray

    with _lock:
        if ray.is_initialized():
            ray.shutdown()
        _embedded = None
