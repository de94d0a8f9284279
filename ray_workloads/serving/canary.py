"""The registry's side of a canary rollout: which version is the incumbent, and how a rollout ends.

``rollout`` moves traffic and judges steps without touching the registry;
here the incumbent is chosen (the model's live version with most traffic,
else its champion), a promotion moves the champion alias before the old
version is retired, and each ending is an outcome that declares its lineage
(both versions in, the candidate out, with why).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ray_workloads.serving import rollout
from ray_workloads.serving.config import ServeConfig
from rayline import registry
from rayline.lineage import DatasetRef

PROMOTED = "promoted"
ROLLED_BACK = "rolled back"


class PreparedRollout(BaseModel):
    base_url: str
    incumbent: registry.ModelVersion
    candidate: registry.ModelVersion

    @property
    def needed(self) -> bool:
        """Whether there is anything to roll out: the candidate is not the incumbent already."""
        return self.incumbent.version != self.candidate.version


class RolloutOutcome(BaseModel):
    """How a rollout ended (``outcome``: promoted or rolled back), after which steps, and why."""

    outcome: str
    prepared: PreparedRollout
    steps: list[rollout.StepReport]
    reason: str

    def details(self) -> dict[str, Any]:
        """What the outcome adds to its event and its lineage beyond the versions and the reason."""
        return {}

    def lineage_inputs(self) -> list[DatasetRef]:
        """The version that served, and the candidate."""
        return [DatasetRef(uri=self.prepared.incumbent.uri), DatasetRef(uri=self.prepared.candidate.uri)]

    def lineage_outputs(self) -> list[DatasetRef]:
        """The candidate, with the outcome."""
        facets = {"outcome": self.outcome, "reason": self.reason, **self.details()}
        return [DatasetRef(uri=self.prepared.candidate.uri, facets=facets)]


class Promotion(RolloutOutcome):
    """A rollout whose every step passed: the candidate is champion."""

    outcome: str = PROMOTED
    alias_move: registry.AliasMove

    def details(self) -> dict[str, Any]:
        return {"alias_move": self.alias_move.model_dump(mode="json")}


def prepare(candidate: registry.ModelVersion, serve: ServeConfig) -> PreparedRollout:
    """Serve the incumbent (the model's live version with most traffic, else its champion) and the candidate at 0%.

    A candidate that is the incumbent already (e.g. a second trigger) is left as it serves: nothing to roll out.
    """
    base_url = rollout.start(serve)
    live = rollout.incumbent_version(serve, candidate.name)
    incumbent = (
        registry.get_version(candidate.name, live) if live else registry.resolve(candidate.name, registry.CHAMPION)
    )
    prepared = PreparedRollout(base_url=base_url, incumbent=incumbent, candidate=candidate)
    if not prepared.needed:
        return prepared
    return prepared.model_copy(update={"base_url": rollout.prepare(incumbent, candidate, serve)})


def promote(prepared: PreparedRollout, steps: list[rollout.StepReport], serve: ServeConfig) -> Promotion:
    """The candidate becomes champion, then takes all of its model's traffic and the old version goes."""
    cand = prepared.candidate
    reason = f"canary rollout passed every step ({', '.join(f'{s.weight:g}%' for s in steps)})"
    move = registry.set_alias(cand.name, registry.CHAMPION, cand.version, reason)
    rollout.retire(prepared.incumbent.version, cand.version, serve, model=cand.name)
    return Promotion(prepared=prepared, steps=steps, reason=reason, alias_move=move)


def roll_back(
    prepared: PreparedRollout, steps: list[rollout.StepReport], reason: str, serve: ServeConfig
) -> RolloutOutcome:
    """All of the model's traffic back on the incumbent; the candidate's deployment goes."""
    cand = prepared.candidate
    rollout.roll_back(prepared.incumbent.version, cand.version, serve, model=cand.name)
    return RolloutOutcome(outcome=ROLLED_BACK, prepared=prepared, steps=steps, reason=reason)
