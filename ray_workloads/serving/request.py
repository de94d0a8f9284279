"""What a ``serve-rollout`` run is asked (:class:`RolloutRequest`): declared once, for the CLI's options, the
flow's one parameter and the deployment's, as ``rayline.ray_workloads.nightly.request`` explains."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from rayline.models.request_fields import split_named_ref
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.ray_workloads.serving.rollout_config import Canary, RolloutConfig
from rayline.specs import DEFAULT_MODEL_NAME

# renewed every ttl/3 while the rollout runs: a crashed holder's lease is taken over this long after it
LEASE_TTL_S = 300.0


class RolloutRequest(Canary):
    """Step ``candidate`` through the traffic ``steps``, each soaked and judged by the ``gates``; a full pass makes
    it champion, a failed gate rolls back."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidate: str = Field(
        "challenger", description="NAME@challenger, NAME@v3, or an alias (challenger) / version (v3) of model_name."
    )
    model_name: str | None = Field(
        None, description=f"Registry name when candidate has no NAME@ ({DEFAULT_MODEL_NAME})."
    )
    probe_uri: str | None = Field(
        None, description="Canary images; default the candidate's training images, or its latest night's inputs."
    )
    lease_wait_s: float = Field(1800.0, ge=0, description="How long a second rollout of the model waits for the first.")
    lease_ttl_s: float = Field(
        LEASE_TTL_S, gt=0, description="A killed rollout's lease is taken over this long after its last renewal."
    )
    require_labelled_win: bool | None = Field(
        None,
        description="The labels must first say the candidate beats the champion (default "
        "RAYLINE_REQUIRE_LABELLED_WIN; docs/quality.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _split_a_named_model(cls, data: Any, info: ValidationInfo) -> Any:
        return split_named_ref(data, "candidate", info)

    def config(self, probe_uri: str, serve: ServeConfig) -> RolloutConfig:
        """The stage's config: this request's canary, probing ``probe_uri`` on ``serve``."""
        return RolloutConfig(**self.model_dump(include=set(Canary.model_fields)), probe_uri=probe_uri, serve=serve)
