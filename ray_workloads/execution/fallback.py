"""What a plan costs beyond its gate: the batches whose outputs were not finite, predicted again in fp32.

A night's images may reach further than the probe's (fp16 ends at 65504), so a batch whose outputs under a
plan other than fp32 eager are not all finite is predicted again by fp32 eager
(:meth:`~rayline.ray_workloads.execution.interface.LoadedModel.logits`). A plan that needed fp32 for more
than :data:`DEMOTE_SHARE` of a night's batches is demoted (:func:`~rayline.ray_workloads.execution.cache.demote`):
its probe did not stand for the night's images, and an overflow a later layer clips back into range is one
no check sees, so later nights of that version on that machine run fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# The share of a night's batches a plan may need fp32 for and keep its place: past it, fp32 from the next night.
DEMOTE_SHARE = 0.01


@dataclass(frozen=True)
class PlanUse:
    """Model calls under a plan: all of them, and those predicted again in fp32, with their images."""

    batches: int = 0
    fallback_batches: int = 0
    fallback_images: int = 0

    def called(self, images: int, fell_back: bool) -> PlanUse:
        """One more model call on ``images`` images, predicted again in fp32 if ``fell_back``."""
        return PlanUse(self.batches + 1, self.fallback_batches + fell_back, self.fallback_images + images * fell_back)

    def __add__(self, other: PlanUse) -> PlanUse:
        return PlanUse(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def __sub__(self, other: PlanUse) -> PlanUse:
        return PlanUse(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def record(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> PlanUse:
        """The counts in a plan record (a block's, a night's); a record without them counted nothing."""
        return cls(*(int(record.get(name) or 0) for name in asdict(cls())))

    def demoted(self) -> bool:
        """Whether the plan needed fp32 for more than :data:`DEMOTE_SHARE` of these batches."""
        return self.fallback_batches > DEMOTE_SHARE * self.batches

    def text(self) -> str:
        """The fallbacks in words; empty when there were none."""
        if not self.fallback_batches:
            return ""
        return (
            f"{self.fallback_batches} of {self.batches} batches ({self.fallback_images} images) predicted again "
            "in fp32: outputs not finite"
        )


def demotion_reason(plan: str, use: PlanUse, night: str) -> str:
    """The reason a demoted plan's fp32 record gives: which plan, on which night, how often it fell back."""
    return (
        f"fp32 eager: {plan} demoted on {night}, {use.text()}, over the {DEMOTE_SHARE:.0%} of a night's batches "
        "a plan may need fp32 for"
    )
