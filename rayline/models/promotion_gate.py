"""The promotion gate: whether a trained candidate becomes champion (or challenger) over the champion it would
replace, on both versions' answers on the candidate's test split, image by image (docs/quality.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from rayline.errors import ConfigError
from rayline.models.split_answers import PairedCounts
from rayline.specs import GATE_ALPHA

if TYPE_CHECKING:
    from rayline.models.registry import ModelVersion


class GateDecision(BaseModel):
    promoted: bool
    reason: str
    candidate: int
    champion: int | None
    metric: str
    candidate_score: float
    champion_score: float | None
    images: int | None = Field(None, description="Test images both versions answered (none: no champion).")
    wins: int | None = Field(None, description="Of those, the candidate right and the champion wrong.")
    losses: int | None = Field(None, description="Of those, the champion right and the candidate wrong.")
    p_value: float | None = Field(None, description="Exact one-sided McNemar p-value of the wins and losses.")
    alpha: float | None = Field(None, description="The p-value the candidate had to reach.")


def gate(
    candidate: ModelVersion,
    champion: ModelVersion | None,
    *,
    metric: str,
    candidate_score: float,
    paired: PairedCounts | None,
    margin: float,
    floor: float,
    alpha: float = GATE_ALPHA,
) -> GateDecision:
    """Decide promotion: the first champion passes ``floor``; a later candidate must beat the champion on the
    same test images, by ``margin`` in accuracy and by an exact one-sided McNemar test at ``alpha``.

    ``candidate_score``: its accuracy on its test split, judged against the floor. ``paired``: both versions' answers on
    that split, image by image (needed with a champion). A point comparison of two accuracies promotes a candidate that
    is no better about half the time; the test promotes one at most ``alpha`` of the time.
    """
    if champion is None:
        passed = candidate_score >= floor
        reason = (
            f"first champion: {metric} {candidate_score:.4f} >= floor {floor:.4f}"
            if passed
            else f"{metric} {candidate_score:.4f} is below the floor {floor:.4f}"
        )
        return GateDecision(
            promoted=passed,
            reason=reason,
            candidate=candidate.version,
            champion=None,
            metric=metric,
            candidate_score=candidate_score,
            champion_score=None,
        )
    if paired is None:
        raise ConfigError(f"v{candidate.version} is judged against champion v{champion.version} image by image")
    p_value = paired.p_value
    significant = p_value <= alpha
    by_margin = paired.candidate_accuracy >= paired.champion_accuracy + margin
    evidence = (
        f"on {paired.images} test images: {_count(paired.wins, 'win')}, {_count(paired.losses, 'loss')}, exact McNemar "
        f"p = {_p_text(p_value)} {'≤' if significant else '>'} {alpha:g}; {metric} {paired.candidate_accuracy:.4f} "
        f"vs {paired.champion_accuracy:.4f}"
    )
    verdict = "beats" if significant and by_margin else "does not beat"
    short = f" by the margin {margin:g}" if significant and not by_margin else ""
    return GateDecision(
        promoted=significant and by_margin,
        reason=f"v{candidate.version} {verdict} champion v{champion.version}{short} {evidence}",
        candidate=candidate.version,
        champion=champion.version,
        metric=metric,
        candidate_score=paired.candidate_accuracy,
        champion_score=paired.champion_accuracy,
        images=paired.images,
        wins=paired.wins,
        losses=paired.losses,
        p_value=p_value,
        alpha=alpha,
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun if n == 1 else noun + ('es' if noun.endswith('s') else 's')}"


def _p_text(p_value: float) -> str:
    return f"{p_value:.4f}" if p_value >= 1e-4 else f"{p_value:.1e}"
