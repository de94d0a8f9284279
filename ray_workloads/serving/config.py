"""What one serving instance is configured with, and this environment's instance from settings
(:func:`config_from_settings`): no Ray, no I/O, so flows and the CLI read it without ``control``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rayline.config import get_settings
from rayline.errors import ConfigError
from rayline.ray_workloads.data.images import DEFAULT_MAX_PIXELS
from rayline.ray_workloads.execution.plan import PlanPolicy


class ServeConfig(BaseModel):
    """One serving instance: its names, HTTP endpoint, input limits and compute shape."""

    model_config = ConfigDict(frozen=True)

    name: str = Field("rayline", pattern=r"^[a-z0-9][a-z0-9-]{0,30}$", description="Prefix of apps and actor.")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    proxy_location: Literal["HeadOnly", "EveryNode"] = "HeadOnly"
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1)
    max_pixels: int = Field(
        DEFAULT_MAX_PIXELS, ge=1, description="Declared pixels above this are refused (422); overrides image_spec."
    )
    replicas: int = Field(1, ge=1, description="ModelServer replicas per version.")
    cpus_per_replica: float = Field(0.25, gt=0)
    max_ongoing_requests: int = Field(64, ge=1, description="Per ModelServer replica (>= max_batch_size).")
    router_replicas: int = Field(1, ge=1)
    router_cpus: float = Field(0.25, gt=0)
    router_max_ongoing_requests: int = Field(256, ge=1)
    stats_per_s: float = Field(2.0, gt=0, description="GET /stats per client address and router replica, a second.")
    stats_burst: int = Field(10, ge=1, description="GET /stats a client may ask at once before stats_per_s applies.")
    max_replicas_per_node: int | None = Field(
        None,
        ge=1,
        description="At most this many replicas of one deployment (router, or a version's model) on one node: "
        "1 spreads them, so losing a node leaves the others serving. None: Serve places them freely.",
    )
    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(0.005, ge=0)
    top_k: int = Field(3, ge=1)
    request_timeout_s: float = Field(30.0, gt=0, description="A version slower than this answers 504.")
    access_log: bool = Field(True, description="Serve's per-request log lines (router and model replicas).")
    deploy_timeout_s: float = Field(300.0, gt=0)
    # Serve's own defaults: how soon a dead replica is noticed (and replaced), and how often a stopping
    # one looks whether its requests have drained (every deletion waits at least one such period)
    model_health_check_period_s: float = Field(10.0, gt=0, description="Serve's health check of model replicas.")
    router_health_check_period_s: float = Field(5.0, gt=0, description="Serve's health check of router replicas.")
    graceful_shutdown_wait_loop_s: float = Field(
        2.0, gt=0, description="How often a stopping replica checks that its requests have drained."
    )
    plan: PlanPolicy = Field(
        default_factory=PlanPolicy,
        description="How each model replica chooses its execution plan (RAYLINE_SERVE_PLAN, RAYLINE_SERVE_PRECISION).",
    )
    default_model: str | None = Field(
        None,
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="Model of /predict (RAYLINE_SERVE_DEFAULT_MODEL); None: the first model served.",
    )

    @property
    def control_actor_name(self) -> str:
        return f"{self.name}-control"

    def version_app(self, model: str, version: int) -> str:
        return f"{self.name}-{model}-v{version}"

    def placement(self) -> dict[str, Any]:
        """Deployment options spreading replicas over nodes; none by default (Serve places them freely)."""
        return {} if self.max_replicas_per_node is None else {"max_replicas_per_node": self.max_replicas_per_node}

    def router_config(self) -> dict[str, Any]:
        """What the router replicas are deployed with: the default model lives in the routing table
        instead, so changing it never restarts a router."""
        return self.model_dump(mode="json", exclude={"default_model"})


def config_from_settings() -> ServeConfig:
    """The serving instance of this environment: HTTP endpoint and default model from settings."""
    settings = get_settings()
    try:
        return ServeConfig(
            host=settings.serve_host,
            port=settings.serve_port,
            default_model=settings.serve_default_model,
            graceful_shutdown_wait_loop_s=settings.serve_graceful_shutdown_wait_loop_s,
            replicas=settings.serve_replicas,
            cpus_per_replica=settings.serve_cpus_per_replica,
            router_replicas=settings.serve_router_replicas,
            max_replicas_per_node=settings.serve_max_replicas_per_node,
            plan=PlanPolicy(mode=settings.serve_plan, precision=settings.serve_precision),
        )
    except ValidationError as exc:  # every field here comes from a RAYLINE_SERVE_… setting: named as the user sets it
        problems = "; ".join(f"{_setting_of(e['loc'])}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors())
        raise ConfigError(f"invalid serving settings: {problems}") from exc


def _setting_of(loc: tuple[int | str, ...]) -> str:
    """The variable a field of the config came from: ``RAYLINE_SERVE_<FIELD>``, the plan's two its own."""
    if loc and loc[0] == "plan":
        return "RAYLINE_SERVE_PRECISION" if "precision" in loc else "RAYLINE_SERVE_PLAN"
    return f"RAYLINE_SERVE_{str(loc[0]).upper()}" if loc else "RAYLINE_SERVE_…"
