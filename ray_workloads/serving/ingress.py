"""The HTTP ingress: Router replicas in front of every model's versions, and the HTTP API they answer.

Every ``SYNC_INTERVAL_S`` each router replica makes one call to the control actor: it flushes its
samples and gets the routing table back, so weights change without a redeploy, in-flight requests
finish where they started, and stats are right with any number of routers. The HTTP API, its headers
and status codes are documented in docs/serving.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import Any

import ray
from ray import serve
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse

from rayline.errors import HttpError, ModelTimeoutError
from rayline.ray_cluster import NAMESPACE
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.ray_workloads.serving.http_api import (
    ANSWER_HEADER,
    KEY_HEADER,
    MODEL_HEADER,
    ROUTES,
    VERSION_HEADER,
    RateLimit,
    error_response,
    multipart_image,
    parse_since,
    read_body,
)
from rayline.ray_workloads.serving.http_api import route as _route
from rayline.ray_workloads.serving.model_server import MODEL_DEPLOYMENT
from rayline.ray_workloads.serving.routing import ModelRoutes, RoutingTable, choose_version
from rayline.ray_workloads.serving.stats import ERROR, OK, REJECTED, Sample

logger = logging.getLogger("ray.serve")

ROUTER_DEPLOYMENT = "Router"
SYNC_INTERVAL_S = 0.5
MAX_PENDING_SAMPLES = 100_000
# the replica died under the request: worth one retry on another (or the replacement) replica;
# a prediction has no side effect, so asking twice is safe
_REPLICA_LOST: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError, ReplicaUnavailableError)


async def _awaited(response: Any) -> Any:
    return await response


class Router:
    """HTTP ingress: routes each request to a model's live version by weight, key or pin; records samples."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = ServeConfig.model_validate(cfg)
        # the control actor knows routers by their Serve replica id, as the driver does (``control.router_replicas``)
        self.router_id = serve.get_replica_context().replica_id.unique_id
        self._stats_limit = RateLimit(self.cfg.stats_per_s, self.cfg.stats_burst)
        self._table = RoutingTable()
        self._synced = asyncio.Event()
        self._handles: dict[str, DeploymentHandle[Any]] = {}  # by application name
        self._samples: list[Sample] = []
        self._rng = random.Random()
        self._control: Any = None
        self._task: asyncio.Task[None] | None = None
        self._ensure_sync()

    def _ensure_sync(self) -> None:
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._sync_forever())
            except RuntimeError:  # no loop yet: the first request or health check starts it
                pass

    async def _sync_forever(self) -> None:
        while True:
            await self._sync_once()
            await asyncio.sleep(SYNC_INTERVAL_S)

    async def _sync_once(self) -> None:
        samples, self._samples = self._samples, []
        try:
            if self._control is None:
                self._control = ray.get_actor(self.cfg.control_actor_name, namespace=NAMESPACE)
            table: RoutingTable = await self._control.sync.remote(self.router_id, self._table.generation, samples)
        except Exception as exc:  # keep routing by the last table; keep the samples for the next try
            self._samples = (samples + self._samples)[-MAX_PENDING_SAMPLES:]
            self._control = None
            logger.warning("router %s: control actor unreachable (%s: %s)", self.router_id, type(exc).__name__, exc)
            return
        if table.generation != self._table.generation:  # handles of applications no longer routed to go
            live = {app for routes in table.models.values() for app in routes.apps.values()}
            self._handles = {app: h for app, h in self._handles.items() if app in live}
        self._table = table
        self._synced.set()

    async def check_health(self) -> None:
        self._ensure_sync()

    async def __call__(self, request: Request) -> JSONResponse:
        self._ensure_sync()
        started = time.perf_counter()
        path = request.url.path.rstrip("/") or "/"
        try:
            model, action = _route(path)
            method = ROUTES[action]
            if request.method != method:
                raise HttpError(405, "MethodNotAllowed", f"use {method} {path}")
            if action == "models":
                return await self._models()
            if action == "predict":
                return await self._predict(request, model, started)
            if action == "healthz":
                return await self._healthz(model)
            return await self._stats(request, model)
        except HttpError as exc:
            return error_response(exc.status, exc.error, exc.detail, headers=exc.headers)
        except Exception as exc:  # a bug of ours: still a JSON answer, and logged
            logger.exception("router %s failed on %s %s", self.router_id, request.method, path)
            return error_response(500, type(exc).__name__, str(exc)[:500])

    async def _routing_table(self) -> RoutingTable:
        try:
            await asyncio.wait_for(self._synced.wait(), timeout=10)
        except TimeoutError as exc:
            raise HttpError(503, "NotReady", "the router has no routing table yet") from exc
        return self._table

    @staticmethod
    def _served(table: RoutingTable, model: str | None) -> tuple[str, ModelRoutes]:
        """The model a request is for (None: the default) and its routes; 404/503 when not served."""
        name = table.resolve(model)
        served = sorted(table.models)
        if name is None:
            raise HttpError(503, "NoLiveVersion", "no model is served (no model version has a traffic weight)")
        if name not in table.models:
            if model is None:  # the configured default is down: the service, not the request, is at fault
                raise HttpError(503, "ModelNotServed", f"the default model {name!r} is not served; served: {served}")
            raise HttpError(404, "ModelNotServed", f"model {name!r} is not served; served models: {served}")
        return name, table.models[name]

    def _pick(self, name: str, routes: ModelRoutes, request: Request) -> tuple[int, bool]:
        """The version to ask and whether it was routed (by weight or key) rather than pinned."""
        pinned = request.headers.get(VERSION_HEADER)
        if pinned is not None:
            text = pinned.strip().lstrip("vV")
            if not text.isdigit():
                raise HttpError(400, "BadRequest", f"{VERSION_HEADER} must be a version number, got {pinned!r}")
            if int(text) not in routes.apps:
                live = sorted(routes.apps)
                raise HttpError(
                    404, "VersionNotLive", f"version {int(text)} of {name} is not live; live versions: {live}"
                )
            return int(text), False
        version = choose_version(routes.weights, request.headers.get(KEY_HEADER), self._rng)
        if version is None:
            raise HttpError(503, "NoLiveVersion", f"no version of model {name} has a traffic weight above 0")
        return version, True

    async def _call_model(self, app: str, version: int, image: bytes) -> dict[str, Any]:
        for attempt in (1, 2):
            handle = self._handles.get(app)
            if handle is None:
                handle = serve.get_deployment_handle(MODEL_DEPLOYMENT, app_name=app)
                self._handles[app] = handle
            response = handle.predict.remote(image)
            try:
                result: dict[str, Any] = await asyncio.wait_for(_awaited(response), self.cfg.request_timeout_s)
                return result
            except TimeoutError as exc:
                response.cancel()  # type: ignore[no-untyped-call]
                raise ModelTimeoutError(f"v{version} did not answer within {self.cfg.request_timeout_s} s") from exc
            except _REPLICA_LOST as exc:
                if attempt == 2:
                    raise
                logger.warning("%s replica lost mid-request (%s); retrying once", app, type(exc).__name__)
        raise AssertionError("unreachable")

    async def _predict(self, request: Request, model: str | None, started: float) -> JSONResponse:
        body = await read_body(request, self.cfg.max_body_bytes)
        content_type = request.headers.get("content-type", "")
        image = body
        if content_type.startswith("multipart/"):
            # in a worker thread: the loop keeps serving every other request meanwhile
            image = await asyncio.to_thread(multipart_image, body, content_type)
        if not image:
            raise HttpError(400, "EmptyBody", "no image bytes: send the image as the body or a multipart 'file' part")
        name, routes = self._served(await self._routing_table(), model)
        version, routed = self._pick(name, routes, request)
        try:
            result = await self._call_model(routes.apps[version], version, image)
        except Exception as exc:  # every failure of the call is an answer: 503/504/500 by its cause
            cause = getattr(exc, "cause", None) or exc
            status = 503 if isinstance(exc, _REPLICA_LOST) else 504 if isinstance(exc, ModelTimeoutError) else 500
            self._record(name, version, started, ERROR, routed)
            logger.warning("%s v%s failed on a request: %s: %s", name, version, type(cause).__name__, cause)
            return error_response(status, type(cause).__name__, str(cause).strip()[-500:], version)
        if not result.pop("ok"):
            self._record(name, version, started, REJECTED, routed)
            return error_response(result["status"], result["error"], result["detail"], version)
        result["latency_ms"] = self._record(name, version, started, OK, routed)
        return JSONResponse(result, headers={ANSWER_HEADER: str(version), MODEL_HEADER: name})

    def _record(self, model: str, version: int, started: float, outcome: int, routed: bool) -> float:
        """Queue a sample for the control actor; ``routed`` False (pinned) keeps it out of the rollout gate."""
        latency_ms = (time.perf_counter() - started) * 1000
        if len(self._samples) < MAX_PENDING_SAMPLES:
            self._samples.append((model, version, time.time(), latency_ms, outcome, routed))
        return round(latency_ms, 3)

    async def _healthz(self, model: str | None) -> JSONResponse:
        table = self._table
        if model is not None:
            self._served(table, model)  # 404 for a model not served
        routes = table.routes(model)
        body = {
            "status": "ok" if any(w > 0 for w in routes.weights.values()) else "unavailable",
            "model": table.resolve(model),
            **_routes_json(routes),
            "generation": table.generation,
        }
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    def _limit_stats(self, request: Request) -> None:
        """429 with Retry-After for a client (by address) asking ``/stats`` faster than its rate."""
        client = request.client.host if request.client is not None else "unknown"
        wait_s = self._stats_limit.retry_after(client, time.monotonic())
        if wait_s is not None:
            raise HttpError(
                429,
                "TooManyRequests",
                f"/stats is limited to {self.cfg.stats_per_s:g} requests a second per client "
                f"(bursts of {self.cfg.stats_burst}); retry in {wait_s:.1f} s",
                headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
            )

    async def _stats(self, request: Request, model: str | None) -> JSONResponse:
        self._limit_stats(request)
        since = parse_since(request.query_params.get("since"))
        table = self._table
        if model is not None:
            self._served(table, model)  # 404 for a model not served
        if self._control is None:
            raise HttpError(503, "NotReady", "the control actor is unreachable")
        name = table.resolve(model)
        stats: dict[int, dict[str, Any]] = await self._control.stats.remote(since, name) if name else {}
        weights = _routes_json(table.routes(name))["weights"]
        versions = {str(v): s for v, s in sorted(stats.items())}
        return JSONResponse({"model": name, "weights": weights, "since": since, "versions": versions})

    async def _models(self) -> JSONResponse:
        table = await self._routing_table()
        return JSONResponse(
            {
                "default": table.default_model,
                "models": {name: _routes_json(routes) for name, routes in table.models.items()},
                "generation": table.generation,
            }
        )


def _routes_json(routes: ModelRoutes) -> dict[str, Any]:
    return {"live_versions": sorted(routes.apps), "weights": {str(v): w for v, w in sorted(routes.weights.items())}}


def router_app(cfg: ServeConfig) -> Any:
    """The ingress application (bound, not yet run)."""
    deployment = serve.deployment(
        name=ROUTER_DEPLOYMENT,
        num_replicas=cfg.router_replicas,
        **cfg.placement(),
        ray_actor_options={"num_cpus": cfg.router_cpus},
        max_ongoing_requests=cfg.router_max_ongoing_requests,
        health_check_period_s=cfg.router_health_check_period_s,
        graceful_shutdown_wait_loop_s=cfg.graceful_shutdown_wait_loop_s,
        max_constructor_retry_count=3,
        max_surge_percent=100,  # Serve's default 0 stops the only router before its replacement is up
        logging_config={"enable_access_log": cfg.access_log},
    )(Router)
    return deployment.bind(cfg.router_config())
