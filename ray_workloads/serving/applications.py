"""Ray Serve applications of a serving instance, deployed together, waited for, deleted: Serve's own calls
under ``control``, its failures mapped onto rayline's errors (a model or weights that fail to load are bad
input, anything else the cluster's)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview

from rayline.errors import ClusterError, InputDataError
from rayline.ray_workloads.serving.config import ServeConfig

# statuses an application is submitted again from, rather than waited for
_REDEPLOYED = (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY, ApplicationStatus.DELETING)


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
        except Exception as exc:  # Serve's API fails in many classes: each is a cluster we cannot use
            raise ClusterError(
                f"could not start Ray Serve on {cfg.host}:{cfg.port}: {type(exc).__name__}: {exc}"
            ) from exc


@dataclass(frozen=True)
class DeployTarget:
    """One application for :func:`run_and_wait` to see RUNNING. ``app`` None: only waited for (someone
    else deploys it); ``in_service``: it answered traffic before (a live version, a running router)."""

    name: str
    app: Any | None
    route_prefix: str | None = None
    in_service: bool = False

    @property
    def deletable(self) -> bool:
        """Whether a failed deploy takes it away: only what this call submitted and nothing was served by.
        Deleting anything else on a timeout could take away all of a model's traffic (or the router)."""
        return self.app is not None and not self.in_service


def has_running_replicas(app: ApplicationStatusOverview | None) -> bool:
    """Whether an application (its ``serve.status()`` overview, None when absent) has a replica serving now,
    whatever its status says (DEPLOYING or UNHEALTHY while a replacement replica starts, say)."""
    if app is None:
        return False
    # replica states are Serve's private str enum: compared by value
    return any(n > 0 for d in app.deployments.values() for state, n in d.replica_states.items() if state == "RUNNING")


def run_and_wait(targets: Sequence[DeployTarget], timeout_s: float) -> dict[str, str]:
    """Deploy Serve applications together and wait until each is RUNNING; ``{name: why}`` of those that
    failed or timed out. Of those, the :attr:`DeployTarget.deletable` ones are deleted again; the others
    are left serving as they can (the caller raises)."""
    if not targets:
        return {}
    submit = [serve.RunTarget(t.app, name=t.name, route_prefix=t.route_prefix) for t in targets if t.app is not None]
    try:
        if submit:
            serve.run_many(submit, wait_for_applications_running=False)
    except Exception as exc:  # Serve's API fails in many classes: each is a cluster we cannot use
        raise ClusterError(f"could not submit Serve applications: {type(exc).__name__}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    settled = (ApplicationStatus.RUNNING, ApplicationStatus.DEPLOY_FAILED)
    while True:
        apps = serve.status().applications
        overviews = {t.name: apps.get(t.name) for t in targets}
        if all(o is not None and o.status in settled for o in overviews.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    failures: dict[str, str] = {}
    for target in targets:
        overview = overviews[target.name]
        if overview is None or overview.status != ApplicationStatus.RUNNING:
            state = overview.status.value if overview is not None else "MISSING"
            detail = overview.message.strip()[-2000:] if overview is not None else ""
            why = f"{state} after {timeout_s:.0f} s: {detail}" if state != "DEPLOY_FAILED" else detail
            if target.deletable:
                serve.delete(target.name, _blocking=False)
            else:
                why += " (left as it is: it served traffic before, or another caller deploys it)"
            failures[target.name] = why
    return failures


def needs_deploy(app: Any) -> bool:
    """Whether an application (its ``serve.status()`` overview, None when absent) must be submitted,
    rather than waited for."""
    return app is None or app.status in _REDEPLOYED


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
    present = serve.status().applications
    doomed = [app for app in apps if app in present]
    try:
        for app in doomed:
            serve.delete(app, _blocking=False)
    except Exception as exc:  # Serve's API fails in many classes: each is a cluster we cannot use
        raise ClusterError(f"could not delete Serve applications {doomed}: {type(exc).__name__}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    while any(app in serve.status().applications for app in doomed):
        if time.monotonic() > deadline:
            raise ClusterError(f"Serve applications {doomed} were not deleted within {timeout_s:.0f} s")
        time.sleep(0.2)
