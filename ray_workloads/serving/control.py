"""Driver-side control of online serving: what the rollout flow calls.

Starts Serve, the router and the control actor (``routing.ServeControl``), deploys versions and moves
traffic through that actor; ``applications`` submits, waits for and deletes Serve applications. Every
call takes ``model=`` (a registry name; None: the default model), so a rollout of one model never
touches another's weights. Weights are relative (``{1: 90, 2: 10}`` routes as ``{1: 0.9, 2: 0.1}``); a
live version left out of ``set_weights`` gets 0. A table change returns once every router replica Serve
runs routes by it (``routing`` says which are waited for), and fails naming those behind after
``wait_s``. ``fence=``: a rollout's lease's fencing token, which the control actor checks (``routing``).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from pydantic import BaseModel
from ray import serve
from ray.serve.schema import ApplicationStatus, ServeInstanceDetails

from rayline import storage
from rayline.errors import ClusterError, ConfigError, InputDataError, RaylineError
from rayline.models.registry import ModelVersion
from rayline.ray_cluster import NAMESPACE
from rayline.ray_workloads.serving import applications
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.ray_workloads.serving.ingress import ROUTER_DEPLOYMENT, SYNC_INTERVAL_S, router_app
from rayline.ray_workloads.serving.model_server import model_app
from rayline.ray_workloads.serving.routing import RoutingTable, ServeControl
from rayline.storage.fencing import Fence

_CALL_TIMEOUT_S = 30.0
# the replica states Serve routes requests to (PENDING_MIGRATION: still serving on a draining node)
_ROUTED_REPLICA_STATES = frozenset({"RUNNING", "PENDING_MIGRATION"})


class VersionStats(BaseModel):
    """Requests a version answered; latency percentiles over successful answers only."""

    version: int
    requests: int
    errors: int = 0
    rejected: int = 0
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def _require_ray() -> None:
    if not ray.is_initialized():
        raise ClusterError("not connected to Ray: call rayline.ray_cluster.connect() first")


def _control(cfg: ServeConfig, *, create: bool = False) -> Any:
    _require_ray()
    if create:
        actor = ray.remote(ServeControl).options(
            name=cfg.control_actor_name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=-1,
        )
        return actor.remote(cfg.name)
    try:
        return ray.get_actor(cfg.control_actor_name, namespace=NAMESPACE)
    except ValueError as exc:
        raise ConfigError(
            f"serving instance {cfg.name!r} is not started: call serving.control.start(cfg) first"
        ) from exc


def _call(ref: Any, what: str) -> Any:
    """``ray.get`` on a control-actor call, mapping failures onto rayline's errors."""
    try:
        return ray.get(ref, timeout=_CALL_TIMEOUT_S)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, RaylineError):
            raise type(cause)(str(cause)) from exc
        raise ClusterError(f"{what} failed: {type(cause).__name__}: {cause}") from exc
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
        raise ClusterError(f"{what}: the serving control actor did not answer: {exc}") from exc


def router_replicas(cfg: ServeConfig) -> dict[str, int | None]:
    """Replica id → PID of each router replica Serve routes requests to now: the routers a table
    change waits for (they sync under their replica id); {} when Serve or the router is not running."""
    try:
        client = serve.context._get_global_client(raise_if_no_controller_running=False)
        # the raw dict: the public status() has no replica ids, and building ServeInstanceDetails pickles
        # Serve's request-router class with process-global settings (racing a deploy in another thread)
        details = client.get_serve_details() if client is not None else {}
    except Exception as exc:  # Serve's private client fails in many classes: all mean no answer
        raise ClusterError(f"could not read the router's replicas from Serve: {type(exc).__name__}: {exc}") from exc
    app = details.get("applications", {}).get(cfg.name)
    deployment = app["deployments"].get(ROUTER_DEPLOYMENT) if app else None
    replicas = deployment["replicas"] if deployment else []
    return {r["replica_id"]: r.get("pid") for r in replicas if r["state"] in _ROUTED_REPLICA_STATES}


def _wait_routers(control: Any, cfg: ServeConfig, generation: int, wait_s: float) -> None:
    """Until every router replica Serve runs routes by ``generation`` (or Serve stops running it)."""
    _wait_for(
        cfg,
        wait_s,
        lambda ids: control.routers_behind.remote(generation, ids),
        f"did not pick up routing generation {generation} in {wait_s} s; Serve still runs them "
        "(paused, overloaded, or cut off from the control actor?)",
    )


def _wait_for(cfg: ServeConfig, wait_s: float, behind: Callable[[list[str]], Any], failure: str) -> None:
    """Until the control-actor call ``behind(router replica ids)`` names none; else fail naming them."""
    deadline = time.monotonic() + wait_s
    while True:
        replicas = router_replicas(cfg)
        late = _call(behind(list(replicas)), "waiting for routers")
        if not late:
            return
        if time.monotonic() > deadline:
            named = ", ".join(f"{r} (pid {replicas.get(r)})" for r in late)
            raise ClusterError(f"router replicas {named} {failure}")
        time.sleep(SYNC_INTERVAL_S / 4)


def start(cfg: ServeConfig) -> str:
    """Serve with its HTTP proxy on ``cfg.host:cfg.port``, the control actor and the router; the base URL.
    Idempotent: a running router with the same configuration is left alone."""
    _require_ray()
    applications.start_serve(cfg)
    client = serve.context._get_global_client()
    http = client.http_config if client is not None else None  # HTTP options are fixed once Serve runs
    if http is not None and (http.host, http.port) != (cfg.host, cfg.port):
        raise ConfigError(
            f"Ray Serve already runs with its HTTP proxy on {http.host}:{http.port}, not {cfg.host}:{cfg.port}; "
            "use that address or shut Serve down first"
        )
    control = _control(cfg, create=True)
    _call(control.prune.remote(list(serve.status().applications)), "reconciling the routing table")
    if cfg.default_model is not None:  # unset leaves what an earlier start (or set_default_model) configured
        generation = _call(control.set_default.remote(cfg.default_model), "setting the default model")
        _wait_routers(control, cfg, generation, 10.0)  # routers already up route /predict by it from now on
    wanted = cfg.router_config()
    # recorded before deploying: a concurrent start() then waits for this deployment instead of
    # submitting its own, which would restart the router under load
    deployed = _call(control.swap_router_config.remote(wanted), "saving the router config")
    router = serve.status().applications.get(cfg.name)
    redeploy = deployed != wanted or applications.needs_deploy(router)
    # else running or being deployed with this config: only wait for it. A router that served
    # (one with a replica running) is never deleted on a timeout: the replicas up keep routing.
    target = applications.DeployTarget(
        cfg.name, router_app(cfg) if redeploy else None, "/", in_service=applications.has_running_replicas(router)
    )
    failures = applications.run_and_wait([target], cfg.deploy_timeout_s)
    if failures:
        _call(control.swap_router_config.remote(None), "clearing the router config")  # the next start() deploys
    applications.raise_deploy_failures(failures)
    base_url = f"http://{cfg.host}:{cfg.port}"
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 30
    while True:  # the proxy answers once it has the route; /healthz is 503 until a version has weight
        try:
            with no_proxy.open(f"{base_url}/healthz", timeout=5):
                return base_url
        except urllib.error.HTTPError as exc:
            if exc.code in (200, 503) and exc.headers.get("content-type", "").startswith("application/json"):
                return base_url
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ClusterError(
                f"the Serve HTTP proxy does not answer on {base_url} (was Serve already started on another port?)"
            )
        time.sleep(0.2)


def deploy_version(model: ModelVersion, cfg: ServeConfig, *, wait_s: float = 10.0, fence: Fence | None = None) -> None:
    """Deploy ``model`` as its own application at weight 0; returns once it is healthy and routable.
    Idempotent: a running application of that version is left alone."""
    deploy_versions([model], cfg, wait_s=wait_s, fence=fence)


def deploy_versions(
    models: Sequence[ModelVersion], cfg: ServeConfig, *, wait_s: float = 10.0, fence: Fence | None = None
) -> None:
    """:func:`deploy_version` for several versions, of any models, at once (replicas start in parallel).

    A version that does not come up within ``cfg.deploy_timeout_s`` is deleted again only if this call
    submitted it and it served nothing before: a live one, above all the incumbent with the traffic, is
    left serving as it can, and the call raises.
    """
    control = _control(cfg)
    table: RoutingTable = _call(control.table.remote(), "reading the routing table")
    for model in models:
        if not storage.exists(model.weights_uri):
            raise InputDataError(f"weights of {model.name} v{model.version} not found at {model.weights_uri}")
    wanted = {cfg.version_app(m.name, m.version): m for m in models}
    apps = serve.status().applications
    live = {app for routes in table.models.values() for app in routes.apps.values()}
    # a version being deployed by someone else (a concurrent rollout) is waited for, not resubmitted:
    # resubmitting restarts its replicas
    failures = applications.run_and_wait(
        [
            applications.DeployTarget(
                name,
                model_app(m, cfg) if applications.needs_deploy(apps.get(name)) else None,
                in_service=name in live or applications.has_running_replicas(apps.get(name)),
            )
            for name, m in wanted.items()
            if name not in apps or apps[name].status != ApplicationStatus.RUNNING
        ],
        cfg.deploy_timeout_s,
    )
    generation = table.generation
    for name, m in wanted.items():
        if name not in failures:
            generation = _call(
                control.register.remote(m.name, m.version, name, fence), f"registering v{m.version} of {m.name}"
            )
    _wait_routers(control, cfg, generation, wait_s)
    applications.raise_deploy_failures(failures)


def set_weights(
    weights: Mapping[int, float],
    cfg: ServeConfig | None = None,
    *,
    model: str | None = None,
    wait_s: float = 10.0,
    fence: Fence | None = None,
) -> None:
    """Switch ``model``'s traffic weights atomically; returns once every router routes by them."""
    cfg = cfg or ServeConfig()
    control = _control(cfg)
    new = {int(v): float(w) for v, w in weights.items()}
    generation = _call(control.set_weights.remote(new, model, fence), "setting weights")
    _wait_routers(control, cfg, generation, wait_s)


def set_default_model(model: str | None, cfg: ServeConfig | None = None, *, wait_s: float = 10.0) -> None:
    """Make ``model`` the one ``/predict`` answers with (None: the first model served); returns once every
    router routes by it. It need not be served yet (``/predict`` answers 503 until it is)."""
    cfg = cfg or ServeConfig()
    control = _control(cfg)
    generation = _call(control.set_default.remote(model), "setting the default model")
    _wait_routers(control, cfg, generation, wait_s)


def routing_table(cfg: ServeConfig | None = None) -> RoutingTable:
    """The whole routing table: every served model's versions and weights, and the default model."""
    table: RoutingTable = _call(_control(cfg or ServeConfig()).table.remote(), "reading the routing table")
    return table


def get_weights(
    cfg: ServeConfig | None = None, *, model: str | None = None, settled: bool = False, wait_s: float = 10.0
) -> dict[int, float]:
    """``model``'s weights ({} when it is not served). ``settled`` first waits until every router routes by
    them: a concurrent rollout may have just changed them, its ``set_weights`` not returned yet."""
    cfg = cfg or ServeConfig()
    control = _control(cfg)
    table: RoutingTable = _call(control.table.remote(), "reading weights")
    if settled:
        _wait_routers(control, cfg, table.generation, wait_s)
    return dict(table.routes(model).weights)


def live_versions(cfg: ServeConfig | None = None, *, model: str | None = None) -> list[int]:
    return sorted(routing_table(cfg).routes(model).apps)


def stats(
    cfg: ServeConfig | None = None,
    *,
    model: str | None = None,
    since: float | None = None,
    fresh: bool = True,
    gated: bool = False,
) -> dict[int, VersionStats]:
    """``model``'s per-version stats since its last reset, or since ``since`` (a unix time, counted from
    the start of its second). ``fresh`` waits until every router has flushed, so every request answered
    before the call counts (else they lag by up to ``SYNC_INTERVAL_S``); ``gated``: the gate's view (``stats``).
    """
    cfg = cfg or ServeConfig()
    control = _control(cfg)
    if fresh:
        mark = _call(control.clock.remote(), "reading the control clock")
        flushed = "did not flush their stats within 10 s"
        _wait_for(cfg, 10.0, lambda ids: control.routers_not_synced_since.remote(mark, ids), flushed)
    raw = _call(control.stats.remote(since, model, gated), "reading stats")
    return {int(v): VersionStats.model_validate(s) for v, s in raw.items()}


def reset_stats(cfg: ServeConfig | None = None, *, model: str | None = None) -> float:
    """Start a fresh stats window for ``model`` (other models keep theirs); returns its start (unix time)."""
    return float(_call(_control(cfg or ServeConfig()).reset_stats.remote(model), "resetting stats"))


def remove_version(
    version: int,
    cfg: ServeConfig | None = None,
    *,
    model: str | None = None,
    wait_s: float = 10.0,
    fence: Fence | None = None,
) -> None:
    """Take a version with weight 0 out of routing, then delete its app (Serve drains its requests)."""
    cfg = cfg or ServeConfig()
    control = _control(cfg)
    table: RoutingTable = _call(control.table.remote(), "reading the routing table")
    name = table.resolve(model)
    app = table.routes(name).apps.get(version) or (cfg.version_app(name, version) if name else None)
    generation = _call(control.retire.remote(version, name, fence), f"retiring version {version} of {name}")
    _wait_routers(control, cfg, generation, wait_s)
    if app is not None:
        applications.delete_apps([app])


def remove_model(model: str, cfg: ServeConfig | None = None, *, wait_s: float = 10.0) -> list[str]:
    """Stop serving every version of ``model``: routers stop routing to it, then its applications are
    deleted (Serve drains them); returns those. A default model gives way to the next one served, unless
    one is configured."""
    cfg = cfg or ServeConfig()
    control = _control(cfg)
    generation, apps = _call(control.remove_model.remote(model), f"removing model {model}")
    _wait_routers(control, cfg, generation, wait_s)
    applications.delete_apps(apps)
    return list(apps)


def replica_pids(cfg: ServeConfig | None = None) -> dict[str, list[int]]:
    """PIDs of the running replicas of each of this instance's applications."""
    cfg = cfg or ServeConfig()
    _require_ray()
    # Serve's own client: the public status() carries no replica details
    client = serve.context._get_global_client()
    if client is None:
        return {}
    details = ServeInstanceDetails(**client.get_serve_details())
    return {
        name: sorted(r.pid for d in app.deployments.values() for r in d.replicas if r.state == "RUNNING" and r.pid)
        for name, app in details.applications.items()
        if name == cfg.name or name.startswith(f"{cfg.name}-")
    }


def shutdown(cfg: ServeConfig | None = None) -> None:
    """Delete this instance's applications (every model's and the router) and control actor;
    stop Serve if nothing else runs on it."""
    cfg = cfg or ServeConfig()
    if not ray.is_initialized():
        return
    apps = [cfg.name]
    try:
        control = ray.get_actor(cfg.control_actor_name, namespace=NAMESPACE)
    except ValueError:
        control = None
    if control is not None:
        table: RoutingTable = _call(control.table.remote(), "reading the routing table")
        apps += [app for routes in table.models.values() for app in routes.apps.values()]
    applications.delete_apps(apps)
    if control is not None:
        _call(control.forget.remote(), "clearing the routing table")
        ray.kill(control, no_restart=True)
    if not serve.status().applications:
        serve.shutdown()  # type: ignore[no-untyped-call]
