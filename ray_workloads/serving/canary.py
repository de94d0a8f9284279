"""The registry's side of a canary rollout: which version is the incumbent, and how a rollout ends.

``rollout`` moves traffic and judges steps without touching the registry; here the incumbent is chosen,
a promotion moves the champion alias before the old version is retired, and each ending is an outcome
that declares its lineage (both versions in, the candidate out, with why). The registry is the source of
truth: a rollout first gives the champion back any weight another version holds (:func:`reconcile`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from rayline.lineage import DatasetRef
from rayline.models import registry
from rayline.ray_workloads.serving import control, rollout
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.storage.fencing import Fence

PROMOTED = "promoted"
ROLLED_BACK = "rolled back"


class Reconciliation(BaseModel):
    """Weights a rollout that did not finish left on versions other than the champion, rolled back."""

    champion: int
    left: dict[int, float]  # version -> % of the model's traffic, as found
    removed: list[int]  # versions of the dead rollout taken out of serving (not this rollout's candidate)

    def describe(self) -> str:
        found = ", ".join(f"v{v} at {share:g}%" for v, share in sorted(self.left.items()))
        removed = f"; removed {', '.join(f'v{v}' for v in self.removed)} from serving" if self.removed else ""
        return (
            f"serving disagreed with the registry at the start ({found}: left by a rollout that did not "
            f"finish, or served while the champion alias moved): rolled all traffic back to the champion "
            f"v{self.champion}{removed}"
        )


def leftover_shares(weights: dict[int, float], champion: int) -> dict[int, float]:
    """The % of traffic each version other than ``champion`` has (those with any): {} when the champion has all."""
    total = sum(w for w in weights.values() if w > 0)
    return {v: round(100.0 * w / total, 2) for v, w in sorted(weights.items()) if w > 0 and v != champion}


class PreparedRollout(BaseModel):
    """What a rollout serves, and its lease's fencing token, carried by each of its traffic moves (None
    outside a rollout flow). Its champion move is fenced by the champion it read: the alias moves only from it."""

    base_url: str
    incumbent: registry.ModelVersion
    candidate: registry.ModelVersion
    champion: int | None = Field(None, description="The champion when the rollout was prepared (None: none).")
    fence: Fence | None = None
    reconciled: Reconciliation | None = None  # what a rollout that did not finish left, rolled back at the start

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
        versions = (self.prepared.incumbent, self.prepared.candidate)
        return [DatasetRef(uri=version.uri, stored_as="model") for version in versions]

    def lineage_outputs(self) -> list[DatasetRef]:
        """The candidate, with the outcome: an alias moved to it (or not), nothing written into it."""
        facets = {"outcome": self.outcome, "reason": self.reason, **self.details()}
        return [DatasetRef(uri=self.prepared.candidate.uri, facets=facets, stored_as="alias")]


class Promotion(RolloutOutcome):
    """A rollout whose every step passed: the candidate is champion."""

    outcome: str = PROMOTED
    alias_move: registry.AliasMove

    def details(self) -> dict[str, Any]:
        return {"alias_move": self.alias_move.model_dump(mode="json")}


def reconcile(candidate: registry.ModelVersion, serve: ServeConfig, fence: Fence | None) -> Reconciliation | None:
    """Roll back to the champion the weight left on other versions (None: none); they leave serving but
    ``candidate``. Called holding the model's rollout lease, so any weight off the champion was left by a
    dead rollout (a finished one leaves one version at 100 %) or served by hand before the alias moved.
    """
    champion = registry.alias_version(candidate.name, registry.CHAMPION)
    if champion is None:  # nothing in the registry to disagree with
        return None
    left = leftover_shares(control.get_weights(serve, model=candidate.name, settled=True), champion)
    if not left:
        return None
    stray = [v for v in left if v != candidate.version]
    rollout.restore(registry.get_version(candidate.name, champion), stray, serve, fence)
    return Reconciliation(champion=champion, left=left, removed=stray)


def prepare(candidate: registry.ModelVersion, serve: ServeConfig, fence: Fence | None = None) -> PreparedRollout:
    """After :func:`reconcile`, serve the incumbent (the model's live version with most traffic, else the
    champion) and the candidate at 0%. The caller holds the model's rollout lease; a candidate that is
    the incumbent already (a second trigger) is left as it serves."""
    base_url = control.start(serve)
    champion = registry.alias_version(candidate.name, registry.CHAMPION)  # what the promotion may move from
    reconciled = reconcile(candidate, serve, fence)
    live = rollout.incumbent_version(serve, candidate.name)
    incumbent = (
        registry.get_version(candidate.name, live) if live else registry.resolve(candidate.name, registry.CHAMPION)
    )
    prepared = PreparedRollout(
        base_url=base_url,
        incumbent=incumbent,
        candidate=candidate,
        champion=champion,
        fence=fence,
        reconciled=reconciled,
    )
    if not prepared.needed:
        return prepared
    return prepared.model_copy(update={"base_url": rollout.prepare(incumbent, candidate, serve, fence)})


def promote(
    prepared: PreparedRollout, steps: list[rollout.StepReport], serve: ServeConfig, rollout_holder: str
) -> Promotion:
    """The candidate becomes champion, then takes all of its model's traffic and the old version goes.

    ``rollout_holder`` must still hold the model's rollout lease, and the champion moves only from the
    version this rollout prepared against (``AliasConflict`` otherwise, serving untouched): a rollout
    paused past its lease's ttl must not overwrite what a rollout that took over has promoted since.
    """
    cand = prepared.candidate
    reason = f"canary rollout passed every step ({', '.join(f'{s.weight:g}%' for s in steps)})"
    move = registry.set_alias(
        cand.name, registry.CHAMPION, cand.version, reason, expected=prepared.champion, rollout_holder=rollout_holder
    )
    rollout.retire(prepared.incumbent.version, cand.version, serve, model=cand.name, fence=prepared.fence)
    return Promotion(prepared=prepared, steps=steps, reason=reason, alias_move=move)


def roll_back(
    prepared: PreparedRollout, steps: list[rollout.StepReport], reason: str, serve: ServeConfig
) -> RolloutOutcome:
    """All of the model's traffic back on the incumbent; the candidate's deployment goes."""
    cand = prepared.candidate
    rollout.retire(cand.version, prepared.incumbent.version, serve, model=cand.name, fence=prepared.fence)
    return RolloutOutcome(outcome=ROLLED_BACK, prepared=prepared, steps=steps, reason=reason)
