"""train-model's gate tells a better model from a worse one: both versions on the same test images, image by
image, an exact one-sided McNemar test at alpha on the images where exactly one of them is right, and the
accuracy margin on top. The promised error rate (a candidate no better than its champion is promoted at
most alpha of the time) and the power are checked by simulating registrations through the gate itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from rayline.errors import InputDataError
from rayline.models import registry, split_answers
from rayline.models.split_answers import PairedCounts
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
from rayline.ray_workloads.training import promotion
from rayline.ray_workloads.training.request import GateOptions
from rayline.specs import GATE_ALPHA, ImageSpec
from tests.unit.test_registry_and_models import _register, answers_right_on

pytestmark = pytest.mark.unit

SPLIT = 360  # test images of one registration in the simulations
REGISTRATIONS = 2000
ALPHA = GATE_ALPHA


def _version(number: int) -> registry.ModelVersion:
    """A version as the gate sees it (only its number is read): nothing stored."""
    return registry.ModelVersion(
        name="digits",
        version=number,
        uri=f"memory://digits/v{number}",
        weights_uri=f"memory://digits/v{number}/weights.pt",
        model_spec=ModelSpec(),
        image_spec=ImageSpec(),
        classes=[str(i) for i in range(10)],
        metrics={},
        code_version="test",
    )


CHAMPION, CANDIDATE = _version(2), _version(3)


def _counts(wins: int, losses: int, images: int = SPLIT, both_wrong: int = 20) -> PairedCounts:
    return PairedCounts(images=images, both_right=images - wins - losses - both_wrong, wins=wins, losses=losses)


def _gate(paired: PairedCounts, margin: float = 0.0) -> registry.GateDecision:
    return registry.gate(
        CANDIDATE,
        CHAMPION,
        metric="test_accuracy",
        candidate_score=paired.candidate_accuracy,
        paired=paired,
        margin=margin,
        floor=0.9,
        alpha=ALPHA,
    )


def test_the_p_value_is_the_exact_binomial_tail_of_the_wins() -> None:
    for wins, losses in [(31, 9), (12, 7), (8, 0), (5, 5), (1, 0), (0, 3), (100, 70), (400, 380)]:
        n = wins + losses
        exact = sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n
        assert split_answers.mcnemar_p(wins, losses) == pytest.approx(exact, rel=1e-9), (wins, losses)
        scipy_p = binomtest(wins, n, 0.5, alternative="greater").pvalue
        assert split_answers.mcnemar_p(wins, losses) == pytest.approx(scipy_p, rel=1e-9), (wins, losses)
    assert split_answers.mcnemar_p(0, 0) == 1.0, "two versions that never disagree: no evidence"


def test_a_tie_is_refused_with_its_figures_in_the_reason() -> None:
    decision = _gate(_counts(wins=9, losses=9))
    assert not decision.promoted
    assert decision.reason.startswith("v3 does not beat champion v2 on 360 test images: 9 wins, 9 losses, ")
    assert "exact McNemar p = 0.5927 > 0.05" in decision.reason
    assert (decision.images, decision.wins, decision.losses, decision.alpha) == (360, 9, 9, ALPHA)
    assert decision.candidate_score == decision.champion_score


def test_a_small_gain_that_chance_explains_is_refused() -> None:
    """12 wins to 7 losses: 5 more images right (1.4 points of accuracy), which the point comparison promoted."""
    decision = _gate(_counts(wins=12, losses=7))
    assert decision.candidate_score > decision.champion_score
    assert not decision.promoted
    assert "12 wins, 7 losses, exact McNemar p = 0.1796 > 0.05" in decision.reason
    assert decision.p_value == pytest.approx(0.1796, abs=1e-4)


def test_a_clear_gain_passes_and_says_its_figures() -> None:
    decision = _gate(_counts(wins=31, losses=9))
    assert decision.promoted
    assert decision.reason.startswith(
        "v3 beats champion v2 on 360 test images: 31 wins, 9 losses, exact McNemar p = 0.0003 ≤ 0.05"
    )
    assert decision.candidate_score - decision.champion_score == pytest.approx(22 / 360)


def test_the_margin_still_applies_to_a_significant_gain() -> None:
    paired = _counts(wins=31, losses=9)  # 6.1 points better, and significant
    assert _gate(paired, margin=0.05).promoted
    refused = _gate(paired, margin=0.07)
    assert not refused.promoted and "does not beat champion v2 by the margin 0.07" in refused.reason
    assert "31 wins, 9 losses" in refused.reason


def test_the_first_champion_needs_only_the_floor() -> None:
    def first(score: float) -> registry.GateDecision:
        return registry.gate(
            CANDIDATE, None, metric="test_accuracy", candidate_score=score, paired=None, margin=0.0, floor=0.9
        )

    assert first(0.91).promoted and first(0.91).reason == "first champion: test_accuracy 0.9100 >= floor 0.9000"
    assert not first(0.89).promoted and "below the floor" in first(0.89).reason
    assert first(0.91).wins is None and first(0.91).p_value is None


def _simulated_promotions(win: float, loss: float, seed: int) -> float:
    """Share of ``REGISTRATIONS`` candidates the gate promotes when, on each image of a ``SPLIT``-image test
    split, the candidate alone is right with probability ``win`` and the champion alone with ``loss``."""
    rng = np.random.default_rng(seed)
    both_right_or_wrong = 1 - win - loss
    counts = rng.multinomial(SPLIT, [win, loss, both_right_or_wrong], size=REGISTRATIONS)
    promoted = [
        _gate(PairedCounts(images=SPLIT, both_right=int(rest), wins=int(w), losses=int(lo))).promoted
        for w, lo, rest in counts
    ]
    return float(np.mean(promoted))


@pytest.mark.parametrize("disagree", [0.02, 0.10, 0.30])
def test_a_candidate_no_better_than_its_champion_is_promoted_at_most_alpha_of_the_time(disagree: float) -> None:
    """No better = as accurate on the population (the worst case of "no better"): each image the two disagree
    on is either's with probability 1/2. The old point comparison promoted about half of these."""
    promoted = _simulated_promotions(disagree / 2, disagree / 2, seed=int(disagree * 100))
    sampling_error = 3 * math.sqrt(ALPHA * (1 - ALPHA) / REGISTRATIONS)
    assert promoted <= ALPHA + sampling_error, promoted


def test_a_candidate_five_points_better_is_promoted_in_most_registrations() -> None:
    """A candidate right on 90 % of images where the champion is right on 85 %, fixing a third of its
    mistakes and making a few of its own (it wins 7.5 % of the images, loses 2.5 %)."""
    promoted = _simulated_promotions(0.075, 0.025, seed=5)
    assert promoted >= 0.85, promoted


def test_answers_are_paired_by_image_whatever_their_row_order() -> None:
    champion_right = np.random.default_rng(1).random(200) < 0.8
    candidate_right = champion_right.copy()
    candidate_right[np.flatnonzero(~champion_right)[:15]] = True  # 15 wins
    candidate_right[np.flatnonzero(champion_right)[:4]] = False  # 4 losses
    candidate, champion = answers_right_on(candidate_right), answers_right_on(champion_right)
    shuffled = champion.take(np.random.default_rng(2).permutation(champion.num_rows))
    paired = split_answers.paired_counts(candidate, shuffled)
    assert (paired.images, paired.wins, paired.losses) == (200, 15, 4)
    assert paired.both_right == int((candidate_right & champion_right).sum())
    assert split_answers.split_digest(shuffled) == split_answers.split_digest(champion), "one split, one name"
    with pytest.raises(InputDataError, match="cover 150 of the candidate's 200 test images"):
        split_answers.paired_counts(candidate, champion.slice(0, 150))


def test_the_champion_is_judged_by_its_answers_kept_for_the_same_images(local_storage: str) -> None:
    """The champion answered this split at its registration: the gate pairs those answers with the candidate's
    (its test split has no data here: an evaluation would fail), and says their figures."""
    weights = state_dict_bytes(build_model(ModelSpec(width=4)))
    champion_right = np.random.default_rng(4).random(300) < 0.85
    better = champion_right.copy()
    better[np.flatnonzero(~champion_right)[:30]] = True
    better[np.flatnonzero(champion_right)[:6]] = False
    champion = _register(weights, float(champion_right.mean()), answers_right_on(champion_right))
    registry.set_alias("digits", registry.CHAMPION, champion.version, "first")
    alike = _register(weights, float(champion_right.mean()), answers_right_on(champion_right))
    refused, moves, _ = promotion.gate_and_move(
        "digits", alike, answers_right_on(champion_right), GateOptions(margin=0.0, floor=0.9)
    )
    assert not refused.promoted and moves == []
    assert "on 300 test images: 0 wins, 0 losses, exact McNemar p = 1.0000 > 0.05" in refused.reason

    candidate = _register(weights, float(better.mean()), answers_right_on(better))
    decision, moves, _ = promotion.gate_and_move(
        "digits", candidate, answers_right_on(better), GateOptions(margin=0.0, floor=0.9)
    )
    assert decision.promoted and [m.version for m in moves] == [candidate.version]
    assert decision.reason.startswith(f"v{candidate.version} beats champion v{champion.version} on 300 test images: ")
    assert (decision.wins, decision.losses) == (30, 6) and "exact McNemar p = 3.5e-05 ≤ 0.05" in decision.reason
