"""Lazy, idempotent connection to Ray (never at import).

* ``RAY_ADDRESS`` set: join that cluster, shipping rayline's own packages with
  ``runtime_env`` so its workers can import ``ray_workloads``.
* Unset: start an embedded local cluster with oversubscribed logical CPUs, so
  that Ray Data, Train and Serve do not starve each other on a 2-core box.

One connection per process; every Prefect task calls :func:`connect` and
reuses it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from rayline.config import Settings, get_settings
from rayline.errors import ClusterError

NAMESPACE = "rayline"
# Non-secret variables workers need to reach storage the way the driver does.
# Credentials are deliberately not forwarded: a cluster brings its own.
_FORWARDED_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "RAYLINE_S3_ENDPOINT_URL",
    "RAYLINE_IO_CONCURRENCY",
)

_lock = threading.Lock()


@dataclass(frozen=True)
class RayConnection:
    """Facts about the cluster this process is connected to (for lineage)."""

    address: str
    job_id: str
    embedded: bool
    num_cpus: float


# Ray defaults that cost seconds per run on small jobs; explicit settings win.
_RAY_DEFAULTS = {
    # the Train controller notices finished/failed workers after this long (default 2 s)
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}


def _runtime_env(remote: bool) -> dict[str, Any]:
    env_vars = {k: os.environ[k] for k in _FORWARDED_ENV if os.environ.get(k)}
    env_vars.update({k: os.environ.get(k, v) for k, v in _RAY_DEFAULTS.items()})
    env: dict[str, Any] = {"env_vars": env_vars}
    if remote:
        import ray_workloads
        import rayline

        env["py_modules"] = [rayline, ray_workloads]
    return env


def _start(settings: Settings) -> bool:
    import ray

    try:
        if settings.ray_address:
            ray.init(
                address=settings.ray_address,
                namespace=NAMESPACE,
                runtime_env=_runtime_env(remote=True),
            )
            return False
        ray.init(
            address="local",
            num_cpus=settings.embedded_num_cpus,
            namespace=NAMESPACE,
            include_dashboard=False,
            # loopback only: nothing of the embedded cluster should face the network
            _node_ip_address="127.0.0.1",
            runtime_env=_runtime_env(remote=False),
        )
        return True
    except Exception as exc:
        target = settings.ray_address or "an embedded local cluster"
        raise ClusterError(f"could not connect to Ray at {target}: {type(exc).__name__}: {exc}") from exc


_embedded: bool | None = None


def connect(settings: Settings | None = None) -> RayConnection:
    """Connect to Ray once per process and describe the connection."""
    global _embedded
    import ray

    settings = settings or get_settings()
    with _lock:
        if not ray.is_initialized():
            _embedded = _start(settings)
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
