"""State that rayline reads back (Tune's pickled experiment state, Train checkpoints) lives apart from inputs."""

from __future__ import annotations

import pytest

from rayline.errors import ConfigError
from rayline.storage import layout

pytestmark = pytest.mark.unit


def test_checkpoints_live_under_their_own_prefix_apart_from_the_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYLINE_STORAGE", "s3://lake/rayline")
    monkeypatch.delenv("RAYLINE_CHECKPOINTS", raising=False)
    assert layout.checkpoints_uri(layout.TUNING_DIR) == "s3://lake/rayline/checkpoints/tuning"
    assert layout.checkpoints_uri(layout.TRAINING_DIR) == "s3://lake/rayline/checkpoints/training"
    monkeypatch.setenv("RAYLINE_CHECKPOINTS", "s3://rayline-state/prod/")
    assert layout.checkpoints_uri(layout.TUNING_DIR) == "s3://rayline-state/prod/tuning"


@pytest.mark.parametrize(
    "checkpoints",
    ["s3://lake/rayline/incoming", "s3://lake/rayline/raw/tuning", "s3://lake/rayline", "s3://lake"],
)
def test_checkpoints_overlapping_an_input_prefix_are_refused(monkeypatch: pytest.MonkeyPatch, checkpoints: str) -> None:
    monkeypatch.setenv("RAYLINE_STORAGE", "s3://lake/rayline")
    monkeypatch.setenv("RAYLINE_CHECKPOINTS", checkpoints)
    with pytest.raises(ConfigError, match="RAYLINE_CHECKPOINTS .* overlaps the input prefix"):
        layout.checkpoints_uri(layout.TUNING_DIR)


def test_a_training_source_under_the_checkpoints_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYLINE_STORAGE", "s3://lake/rayline")
    monkeypatch.setenv("RAYLINE_CHECKPOINTS", "s3://state/rayline")
    layout.check_input_apart_from_checkpoints("s3://lake/photos", "source_uri")
    layout.check_input_apart_from_checkpoints("s3://state/rayline-photos", "source_uri")  # a sibling, not inside
    with pytest.raises(ConfigError, match="source_uri .* overlaps"):
        layout.check_input_apart_from_checkpoints("s3://state/rayline/tuning/x", "source_uri")
