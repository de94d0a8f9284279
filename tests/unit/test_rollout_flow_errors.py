"""The rollout flow's answer to a champion move that lost to another writer.

A rollout paused past its lease's ttl between its last step and its champion move finds the
champion moved by the rollout that took over (``AliasConflict`` from the fenced move). Serving is
that rollout's now: rolling back under the stale fence would be refused by the control actor, or
undo the other's move. The flow's tasks are replaced here; what is checked is the flow's decision.
"""

from __future__ import annotations

from typing import Any

import pytest

from rayline.errors import AliasConflict, LeaseLost
from rayline.flows import serve_rollout
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.ray_workloads.serving.rollout import RolloutConfig, StepReport
from rayline.specs import ImageSpec, ModelSpec
from rayline.tasks.serve import PreparedRollout

pytestmark = pytest.mark.unit


def _version(number: int) -> ModelVersion:
    return ModelVersion(
        name="digits",
        version=number,
        uri=f"mem://models/digits/v{number}",
        weights_uri=f"mem://models/digits/v{number}/weights.pt",
        model_spec=ModelSpec(num_classes=10, width=4),
        image_spec=ImageSpec(),
        classes=[str(i) for i in range(10)],
        metrics={},
        code_version="test",
    )


class _StillHeld:
    """A lease that stays held: the flow's lease checks pass, as they do until the move itself."""

    class lease:  # noqa: N801 - the attribute HeldLease exposes
        holder = "rollout-a"

    def ensure_held(self) -> None:
        return None


def test_a_champion_move_that_lost_to_another_writer_leaves_serving_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rolled_back: list[Any] = []

    def passing_step(cfg: RolloutConfig, prepared: PreparedRollout, weight: float, *_: Any, **__: Any) -> StepReport:
        return StepReport(
            weight=weight, candidate=None, incumbent=None, incumbent_p95_ms=None, agreement=None, passed=True, reason=""
        )

    def losing_move(*_: Any) -> None:
        raise AliasConflict("champion of digits is now on v3, not v1", current=3)

    monkeypatch.setattr(serve_rollout, "rollout_step_task", passing_step)
    monkeypatch.setattr(serve_rollout, "promote_task", losing_move)
    monkeypatch.setattr(serve_rollout, "roll_back_task", lambda *args: rolled_back.append(args))
    monkeypatch.setattr(serve_rollout, "alias_version_task", lambda *_: 3)
    prepared = PreparedRollout(base_url="http://127.0.0.1:1", incumbent=_version(1), candidate=_version(2), champion=1)

    with pytest.raises(LeaseLost, match="lost the champion to another writer.*now on v3"):
        serve_rollout._roll_out_prepared(
            RolloutConfig(steps=[100.0], probe_uri="mem://probes"),
            prepared,
            ServeConfig(),
            _StillHeld(),  # type: ignore[arg-type]
        )
    assert rolled_back == []
