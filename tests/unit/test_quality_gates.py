"""Promotion gated on the labels: the paired test over served and shadow nights, asked by train-model's gate.

Planted labels where the answer is known each way: a challenger scored in the champion's shadow that is
better, one that agrees with the champion more but is worse, and one without labels (inconclusive: it
waits). The rollout's gate asks the same test (``rayline.flows.serve_rollout._labelled_win``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rayline.errors import QualityGateFailed
from rayline.flows import serve_rollout
from rayline.models import registry
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
from rayline.ray_workloads.quality import labels_import, reading
from rayline.ray_workloads.training import promotion
from rayline.ray_workloads.training.request import GateOptions
from rayline.storage import layout, leases
from rayline.tasks import rollouts as tasks_rollouts
from rayline.tasks.serve import PreparedRollout
from tests.unit.test_quality import commit_night
from tests.unit.test_registry_and_models import _register, answers_at

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
    config = labels_import.LabelsImportConfig(  # every photo of the night: a census, declared random
        file_uri=str(labels),
        root=root,
        model_name="digits",
        classes=DIGITS,
        key_base="s3://photos/incoming",
        selection="random",
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
        "digits", candidate, answers_at(0.97), GateOptions(margin=0.0, floor=0.9), labelled_root=local_storage
    )
    outcome = {"better": "passed", "worse": "failed"}.get(planted, "inconclusive")
    assert labelled is not None and labelled.outcome == outcome
    assert decision.promoted is promoted and [m.alias for m in moves] == ([alias] if alias else [])
    expected_champion = candidate.version if alias == registry.CHAMPION else champion.version
    assert registry.alias_version("digits", registry.CHAMPION) == expected_champion
    if planted == "none":
        assert "challenger until the labels decide" in decision.reason


def test_a_rollout_is_judged_against_the_champion_it_replaces_when_that_changed_while_it_waited_for_the_lease(
    local_storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v2 becomes champion while v3's rollout waits on the model's rollout lease: v3, better than v1 but worse
    than v2, is judged against v2 and refused. Serving is left out (the flow's tasks that move traffic are
    replaced); the lease, the registry and the labels are real."""
    weights = state_dict_bytes(build_model(ModelSpec(width=4)))
    for accuracy in (0.9, 0.95, 0.93):
        _register(weights, accuracy)
    registry.set_alias("digits", registry.CHAMPION, 1, "first")
    _plant_three_versions(local_storage, tmp_path)
    waiting, judged = threading.Event(), []

    @contextmanager
    def announced_lease(*args: Any, **kwargs: Any) -> Iterator[Any]:
        waiting.set()  # the rollout asks for the lease now
        with tasks_rollouts.rollout_lease(*args, **kwargs) as lease:
            yield lease

    def prepare(candidate: registry.ModelVersion, serve: Any, fence: Any) -> PreparedRollout:
        champion = registry.alias_version("digits", registry.CHAMPION)  # as canary.prepare reads it
        incumbent = registry.get_version("digits", champion or 1)
        return PreparedRollout(
            base_url="http://127.0.0.1:1", incumbent=incumbent, candidate=candidate, champion=champion
        )

    def gate(root: str, name: str, champion: int, challenger: int) -> Any:
        judged.append(champion)
        return reading.labelled_gate(root, name, champion, challenger)

    monkeypatch.setattr(serve_rollout, "rollout_lease", announced_lease)
    monkeypatch.setattr(serve_rollout, "requested_version", lambda ref, name: registry.resolve(name or "digits", ref))
    monkeypatch.setattr(serve_rollout, "probe_source_task", lambda version: "mem://probes")
    monkeypatch.setattr(serve_rollout, "alias_version_task", registry.alias_version)
    monkeypatch.setattr(serve_rollout, "labelled_gate_task", gate)
    monkeypatch.setattr(serve_rollout, "prepare_rollout_task", prepare)
    outcome: list[BaseException | Any] = []

    def roll_out_v3() -> None:
        try:
            outcome.append(
                serve_rollout.serve_rollout.fn(
                    serve_rollout.RolloutRequest(candidate="v3", require_labelled_win=True, lease_wait_s=60)
                )
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    with leases.held(registry.rollout_lease_uri("digits"), "another-rollout", ttl_s=60, wait_s=0) as other:
        rollout = threading.Thread(target=roll_out_v3)
        rollout.start()
        assert waiting.wait(60)
        registry.set_alias(
            "digits", registry.CHAMPION, 2, "the other rollout promoted it", rollout_holder=other.lease.holder
        )
    rollout.join(120)
    assert judged == [2], "judged against the champion it would replace, not the one before it waited"
    assert isinstance(outcome[0], QualityGateFailed) and "not rolled out: failed" in str(outcome[0])
    assert registry.alias_version("digits", registry.CHAMPION) == 2


def _plant_three_versions(root: str, tmp_path: Path) -> None:
    """600 photos labelled whole (declared random): v1 right on 80 %, v3 fixes 50 of its mistakes, v2 fixes 100.
    Night 1: v1 served, v3 in its shadow; night 2: v2 served, v3 in its shadow."""
    n = 600
    truth = np.arange(n) % 10
    v1_right = np.random.default_rng(5).random(n) < 0.8
    mistakes = np.flatnonzero(~v1_right)
    v3_right, v2_right = v1_right.copy(), v1_right.copy()
    v3_right[mistakes[:50]] = True
    v2_right[mistakes[:100]] = True

    def answers(right: np.ndarray) -> list[tuple[str, str, int, float]]:
        predicted = np.where(right, truth, (truth + 1) % 10)
        return [(_photo(i), f"e{i}", int(predicted[i]), 0.8) for i in range(n)]

    commit_night(root, NIGHT, 1, answers(v1_right), model="digits", classes=DIGITS)
    commit_night(root, NIGHT, 3, answers(v3_right), table_name=layout.SHADOW_TABLE, model="digits", classes=DIGITS)
    commit_night(root, "2026-12-02", 2, answers(v2_right), model="digits", classes=DIGITS)
    commit_night(
        root, "2026-12-02", 3, answers(v3_right), table_name=layout.SHADOW_TABLE, model="digits", classes=DIGITS
    )
    labels = tmp_path / "census.csv"
    labels.write_text("uri,label\n" + "".join(f"{_photo(i)},{truth[i]}\n" for i in range(n)))
    config = labels_import.LabelsImportConfig(
        file_uri=str(labels), root=root, model_name="digits", classes=DIGITS, key_base="s3://photos", selection="random"
    )
    assert labels_import.run(config).imported == n
