"""Promotion gated on the labels: the paired test over served and shadow nights, asked by train-model's gate.

Planted labels where the answer is known each way: a challenger scored in the champion's shadow that is
better, one that agrees with the champion more but is worse, and one without labels (inconclusive: it
waits). The rollout's gate asks the same test (``rayline.flows.serve_rollout._labelled_win``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rayline.models import registry
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
from rayline.ray_workloads.quality import labels_import, reading
from rayline.ray_workloads.training import promotion
from rayline.storage import layout
from tests.unit.test_quality import commit_night
from tests.unit.test_registry_and_models import _register

pytestmark = pytest.mark.unit

DIGITS = [str(i) for i in range(10)]
NIGHT = "2026-12-01"


def _photo(i: int) -> str:
    return f"s3://photos/incoming/dt={NIGHT}/img-{i:04d}.jpg"


def plant_paired_night(root: str, tmp_path: Path, champion_right: np.ndarray, challenger_right: np.ndarray) -> None:
    """v1 served the night, v2 was scored in its shadow; every photo labelled with its true class. Where both
    are wrong a challenger that is better says something else, one that is worse the champion's answer."""
    n = champion_right.size
    truth = np.arange(n) % 10

    def answers(right: np.ndarray, wrong_as: int) -> list[tuple[str, str, int, float]]:
        predicted = np.where(right, truth, (truth + wrong_as) % 10)
        return [(_photo(i), f"e{i}", int(predicted[i]), 0.8) for i in range(n)]

    commit_night(root, NIGHT, 1, answers(champion_right, 1), model="digits", classes=DIGITS)
    better = challenger_right.sum() > champion_right.sum()
    shadow = answers(challenger_right, 2 if better else 1)
    commit_night(root, NIGHT, 2, shadow, table_name=layout.SHADOW_TABLE, model="digits", classes=DIGITS)
    labels = tmp_path / "labels.csv"
    labels.write_text("uri,label\n" + "".join(f"{_photo(i)},{truth[i]}\n" for i in range(n)))
    config = labels_import.LabelsImportConfig(
        file_uri=str(labels), root=root, model_name="digits", classes=DIGITS, key_base="s3://photos/incoming"
    )
    assert labels_import.run(config).imported == n


def champion_right_answers(n: int = 300) -> np.ndarray:
    return np.random.default_rng(3).random(n) < 0.85


def _better(champion_right: np.ndarray) -> np.ndarray:
    """Fixes 40 of the champion's mistakes and breaks 8 of its right answers, its wrong ones unlike the champion's."""
    right = champion_right.copy()
    right[np.flatnonzero(~champion_right)[:40]] = True
    right[np.flatnonzero(champion_right)[:8]] = False
    return right


def worse_but_alike(champion_right: np.ndarray) -> np.ndarray:
    """The champion's answers on all but 12 photos it had right: agrees on 96 %, and is worse."""
    right = champion_right.copy()
    right[np.flatnonzero(champion_right)[:12]] = False
    return right


def test_a_shadowed_challenger_is_judged_on_the_labels_both_versions_predicted(tmp_path: Path) -> None:
    champion_right = champion_right_answers()
    better_root, worse_root = str(tmp_path / "better"), str(tmp_path / "worse")
    plant_paired_night(better_root, tmp_path, champion_right, _better(champion_right))
    plant_paired_night(worse_root, tmp_path, champion_right, worse_but_alike(champion_right))

    better = reading.labelled_gate(better_root, "digits", 1, 2)
    worse = reading.labelled_gate(worse_root, "digits", 1, 2)
    assert better.outcome == "passed" and (better.challenger_wins, better.champion_wins) == (40, 8)
    assert worse.outcome == "failed" and worse.champion_wins == 12
    assert worse.agreement is not None and better.agreement is not None and worse.agreement > better.agreement
    # the monitor's reading gives the shadowed version its own figures, beside the served one's
    nights = reading.labelled_reading(better_root, "digits", DIGITS, 14, 1, 2).nights
    assert {(q.model_version, q.table) for q in nights} == {(1, layout.PREDICTIONS_TABLE), (2, layout.SHADOW_TABLE)}
    assert reading.labelled_gate(str(tmp_path / "no-labels"), "digits", 1, 2).outcome == "inconclusive"


@pytest.mark.parametrize(
    ("planted", "promoted", "alias"),
    [("better", True, registry.CHAMPION), ("worse", False, None), ("none", True, registry.CHALLENGER)],
)
def test_the_train_model_gate_moves_the_champion_only_on_a_labelled_win(
    local_storage: str, tmp_path: Path, planted: str, promoted: bool, alias: str | None
) -> None:
    weights = state_dict_bytes(build_model(ModelSpec(width=4)))
    champion = _register(weights, 0.95)
    candidate = _register(weights, 0.97)
    assert candidate.version == 2  # the planted challenger's version
    registry.set_alias("digits", registry.CHAMPION, champion.version, "first")
    champion_right = champion_right_answers()
    if planted != "none":
        challenger_right = _better(champion_right) if planted == "better" else worse_but_alike(champion_right)
        plant_paired_night(local_storage, tmp_path, champion_right, challenger_right)

    decision, moves, labelled = promotion.gate_and_move(
        "digits", candidate, 0.97, margin=0.0, floor=0.9, labelled_root=local_storage
    )
    outcome = {"better": "passed", "worse": "failed"}.get(planted, "inconclusive")
    assert labelled is not None and labelled.outcome == outcome
    assert decision.promoted is promoted and [m.alias for m in moves] == ([alias] if alias else [])
    expected_champion = candidate.version if alias == registry.CHAMPION else champion.version
    assert registry.alias_version("digits", registry.CHAMPION) == expected_champion
    if planted == "none":
        assert "challenger until the labels decide" in decision.reason
