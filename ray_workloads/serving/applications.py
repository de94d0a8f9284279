"""Ray Serve applications of a serving instance: deployed together, waited for, deleted.

The plumbing under ``control``: Serve's own calls, with its failures mapped onto rayline's
errors (a model or weights that fail to load are bad input, anything else the cluster's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray
from ray import serve
from ray.serve.schema import ApplicationStatus

from ray_workloads.serving.config import ServeConfig
from rayline.errors import ClusterError, InputDataError


def app_status(name: str) -> ApplicationStatus | None:
    """The status of application ``name``; None when there is none."""
    app = serve.status().applications.get(name)
    return app.status if app is not None else None


def start_serve(cfg: ServeConfig) -> None:
    """``serve.start``, tolerating another driver starting Serve at the same moment."""
    for attempt in (1, 2):
        try:
            serve.start(proxy_location=cfg.proxy_location, http_options={"host": cfg.host, "port": cfg.port})
            return
        except ray.exceptions.ActorAlreadyExistsError as exc:
            if attempt == 2:  # the controller someone else created should be reachable by now
                raise ClusterError(f"could not connect to Ray Serve's controller: {exc}") from exc
            time.sleep(1.0)  # lost the race to create Serve's controller: connect to theirs
        except Exception as exc:
            raise ClusterError(
                f"could not start Ray Serve on {cfg.host}:{cfg.port}: {type(exc).__name__}: {exc}"
            ) from exc


def run_and_wait(targets: list[tuple[str, Any, str | None]], timeout_s: float) -> dict[str, str]:
    """Deploy Serve applications ``(name, app, route_prefix)`` together and wait until each is RUNNING.

    An ``app`` of None is not submitted, only waited for (someone else is deploying it).
    Returns ``{name: why}`` of those that failed or timed out; they are deleted again.
    """
    if not targets:
        return {}
    submit = [serve.RunTarget(app, name=name, route_prefix=prefix) for name, app, prefix in targets if app is not None]
    try:
        if submit:
            serve.run_many(submit, wait_for_applications_running=False)
    except Exception as exc:
        raise ClusterError(f"could not submit Serve applications: {type(exc).__name__}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    settled = (ApplicationStatus.RUNNING, ApplicationStatus.DEPLOY_FAILED)
    while True:
        apps = serve.status().applications
        overviews = {name: apps.get(name) for name, _, _ in targets}
        if all(o is not None and o.status in settled for o in overviews.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    failures: dict[str, str] = {}
    for name, overview in overviews.items():
        if overview is None or overview.status != ApplicationStatus.RUNNING:
            state = overview.status.value if overview is not None else "MISSING"
            detail = overview.message.strip()[-2000:] if overview is not None else ""
            failures[name] = f"{state} after {timeout_s:.0f} s: {detail}" if state != "DEPLOY_FAILED" else detail
            serve.delete(name, _blocking=False)
    return failures


def needs_deploy(app: Any) -> bool:
    """Whether an application (its ``serve.status()`` overview, None when absent) must be submitted,
    rather than waited for."""
    return app is None or app.status in (
        ApplicationStatus.DEPLOY_FAILED,
        ApplicationStatus.UNHEALTHY,
        ApplicationStatus.DELETING,
    )


def raise_deploy_failures(failures: dict[str, str]) -> None:
    """The failures of :func:`run_and_wait` as one error: bad input when a model or its weights failed."""
    if not failures:
        return
    text = "; ".join(f"{name}: {why}" for name, why in failures.items())
    if any(n in text for n in ("InputDataError", "UnsafeCheckpointError", "ConfigError")):
        raise InputDataError(f"Serve applications failed to deploy (bad model or weights): {text}")
    raise ClusterError(f"Serve applications failed to deploy: {text}")


def delete_apps(apps: Sequence[str], timeout_s: float = 120.0) -> None:
    """Delete Serve applications all at once (each drains for a few seconds) and wait until they are gone."""
    doomed = [app for app in apps if app_status(app) is not None]
    try:
        for app in doomed:
            serve.delete(app, _blocking=False)
    except Exception as exc:
        raise ClusterError(f"could not delete Serve applications {doomed}: {type(exc).__name__}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    while any(app in serve.status().applications for app in doomed):
        if time.monotonic() > deadline:
            raise ClusterError(f"Serve applications {doomed} were not deleted within {timeout_s:.0f} s")
        time.sleep(0.2)
