from __future__ import annotations

import numpy as np
import pytest

from rayline.ray_workloads.training.evaluate import classification_metrics, confusion_png, curves_png

pytestmark = pytest.mark.unit


def test_metrics_match_a_hand_count() -> None:
    y_true = np.array([0, 0, 1, 1, 2, 2])
    y_pred = np.array([0, 1, 1, 1, 2, 0])
    accuracy, per_class, confusion = classification_metrics(y_true, y_pred, ["a", "b", "c"])
    assert accuracy == pytest.approx(4 / 6)
    assert confusion.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    by_name = {c.name: c for c in per_class}
    assert by_name["a"].precision == pytest.approx(1 / 2) and by_name["a"].recall == pytest.approx(1 / 2)
    assert by_name["b"].precision == pytest.approx(2 / 3) and by_name["b"].recall == 1.0
    assert by_name["c"].precision == 1.0 and by_name["c"].recall == pytest.approx(1 / 2)
    assert [c.support for c in per_class] == [2, 2, 2]


def test_a_class_never_predicted_has_zero_precision_not_an_error() -> None:
    _, per_class, _ = classification_metrics(np.array([0, 1]), np.array([0, 0]), ["a", "b"])
    assert per_class[1].precision == 0.0 and per_class[1].recall == 0.0


def test_plots_are_png() -> None:
    assert confusion_png(np.eye(3, dtype=int), ["a", "b", "c"], "t").startswith(b"\x89PNG")
    assert curves_png({"val": [(0.0, 0.5), (1.0, 0.9)]}, "acc", "t").startswith(b"\x89PNG")
