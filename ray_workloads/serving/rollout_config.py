"""How a rollout steps and judges (:class:`Canary`, :class:`GateConfig`) and the stage's config
(:class:`RolloutConfig`): pydantic models alone, so the request and the CLI read them without ``rollout``,
which loads Ray Serve and the registry."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from rayline.ray_workloads.serving.config import ServeConfig


class GateConfig(BaseModel):
    max_error_rate: float = Field(0.01, ge=0.0, le=1.0, description="The candidate's 5xx share a window allows.")
    max_p95_ratio: float = Field(1.5, gt=0.0, description="Candidate p95 / incumbent p95.")
    p95_slack_ms: float = Field(15.0, ge=0.0, description="Absolute latency slack added to the ratio bound.")
    min_agreement: float = Field(0.9, ge=0.0, le=1.0, description="Agreement with the incumbent the first step needs.")
    min_requests: int = Field(20, ge=1, description="Candidate answers a window needs before it can pass.")


class Canary(BaseModel):
    """How a rollout steps and judges: declared once, for the request and the stage's config alike."""

    steps: list[float] = Field(
        default_factory=lambda: [10.0, 50.0, 100.0], description="The candidate's traffic %, rising to 100."
    )
    soak_s: float = Field(10.0, gt=0.0, description="How long each step holds before it is judged.")
    probe_rps: float = Field(20.0, ge=0.0, description="Canary requests per second sent during each soak.")
    probe_images: int = Field(64, ge=1, description="Images of the first step's agreement check.")
    gates: GateConfig = Field(default_factory=GateConfig)

    @field_validator("steps")
    @classmethod
    def _steps_rise_to_100(cls, steps: list[float]) -> list[float]:
        if not steps or any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)) or steps[-1] != 100:
            raise ValueError(f"steps must rise strictly within (0, 100] and end at 100, got {steps}")
        return steps


class RolloutConfig(Canary):
    probe_uri: str = Field(description="Prefix of images used for canary probes and the agreement check.")
    serve: ServeConfig = Field(default_factory=ServeConfig)
