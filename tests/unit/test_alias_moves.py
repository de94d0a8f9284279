"""Alias moves are compare-and-swaps: a move never overwrites one it did not see, and says what it replaced.

Champion moves outside a rollout take the model's rollout lease. The same
moves on the S3-protocol server: tests/integration/test_registry_on_s3.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from rayline.errors import AliasConflict, LeaseLost
from rayline.models import registry
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
from rayline.ray_workloads.training import promotion
from rayline.ray_workloads.training.request import GateOptions
from rayline.storage import conditional, leases
from tests.unit.test_registry_and_models import _register, _register_keyed, answers_at

pytestmark = pytest.mark.unit

MOVERS = 8
ROLLOUT = "flow run rollout-of-digits (1234) on host-9 pid 1"


def _versions(count: int) -> list[int]:
    return [_register_keyed(None).version for _ in range(count)]


def _move_at_once(moves: list[Callable[[], registry.AliasMove]]) -> list[registry.AliasMove | AliasConflict]:
    """Every move started together (a barrier); each one's move or its conflict."""
    start = threading.Barrier(len(moves))

    def run(move: Callable[[], registry.AliasMove]) -> registry.AliasMove | AliasConflict:
        start.wait()
        try:
            return move()
        except AliasConflict as exc:
            return exc

    with ThreadPoolExecutor(len(moves)) as pool:
        return list(pool.map(run, moves))


def test_concurrent_moves_of_one_alias_lose_no_move(local_storage: str) -> None:
    """Racing movers each replace a move they saw: no two replace the same one (no last-writer-wins)."""
    first, *others = _versions(MOVERS + 1)
    registry.set_alias("digits", registry.CHALLENGER, first, "first")

    def mover(version: int) -> Callable[[], registry.AliasMove]:
        return lambda: registry.set_alias("digits", registry.CHALLENGER, version, f"mover of v{version}")

    outcomes = _move_at_once([mover(v) for v in others])
    moves = [o for o in outcomes if isinstance(o, registry.AliasMove)]
    assert moves, "at least one mover wins"
    previous = [m.previous for m in moves]
    assert len(set(previous)) == len(previous), f"two moves replaced the same version: {previous}"
    # the winners form one chain from v<first> to the alias as stored
    chain = {m.previous: m.version for m in moves}
    at = first
    while at in chain:
        at = chain.pop(at)
    assert not chain and registry.alias_version("digits", registry.CHALLENGER) == at
    for conflict in (o for o in outcomes if isinstance(o, AliasConflict)):
        assert "moved it" in str(conflict) and conflict.current is not None


def test_moves_gated_against_the_same_version_have_exactly_one_winner(local_storage: str) -> None:
    """Every mover decided against v<first> (``expected``): one moves the alias, the others get a conflict."""
    first, *others = _versions(MOVERS + 1)
    registry.set_alias("digits", registry.CHALLENGER, first, "first")

    def mover(version: int) -> Callable[[], registry.AliasMove]:
        return lambda: registry.set_alias("digits", registry.CHALLENGER, version, "gated", expected=first)

    outcomes = _move_at_once([mover(v) for v in others])
    [winner] = [o for o in outcomes if isinstance(o, registry.AliasMove)]
    assert winner.previous == first
    assert registry.alias_move("digits", registry.CHALLENGER) == winner
    conflicts = [o for o in outcomes if isinstance(o, AliasConflict)]
    assert len(conflicts) == MOVERS - 1
    # lost at the check (it read the winner's move) or at the swap (it read v<first>, the winner wrote first)
    assert all(c.current == winner.version and f"v{winner.version} (gated)" in str(c) for c in conflicts)


def test_an_alias_moved_between_a_movers_read_and_its_write_is_not_overwritten(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other writer moves the alias right after this mover read it: this mover's swap fails, the other's
    move stands, and its ``previous`` is what it replaced."""
    one, two, three = _versions(3)
    registry.set_alias("digits", registry.CHALLENGER, one, "first")
    other: list[registry.AliasMove] = []
    _move_after_the_next_alias_read(monkeypatch, lambda: other.append(_other_move(three)))
    with pytest.raises(AliasConflict, match=f"another writer moved it to v{three}"):
        registry.set_alias("digits", registry.CHALLENGER, two, "this mover")
    assert other[0].previous == one and registry.alias_move("digits", registry.CHALLENGER) == other[0]


def _other_move(version: int) -> registry.AliasMove:
    return registry.set_alias("digits", registry.CHALLENGER, version, "the other writer")


def _move_after_the_next_alias_read(monkeypatch: pytest.MonkeyPatch, move: Callable[[], None]) -> None:
    """Run ``move`` (another writer) once, right after the next read of an alias: between a read and its swap."""
    real_read = conditional.read_versioned
    pending = [move]

    def read_then_let_the_other_writer_move(uri: str) -> conditional.Versioned | None:
        current = real_read(uri)
        if "/aliases/" in uri and pending:
            pending.pop()()
        return current

    monkeypatch.setattr(conditional, "read_versioned", read_then_let_the_other_writer_move)


def test_a_champion_move_outside_a_rollout_is_refused_while_the_rollout_holds_its_lease(local_storage: str) -> None:
    """While a rollout holds the model's lease the champion is that rollout's to move; outside moves are refused."""
    one, two, three = _versions(3)
    registry.set_alias("digits", registry.CHAMPION, one, "first")
    held = leases.try_acquire(registry.rollout_lease_uri("digits"), ROLLOUT, ttl_s=60)
    assert held is not None
    with pytest.raises(AliasConflict, match=r"the rollout of model digits .*rollout-of-digits") as info:
        registry.set_alias("digits", registry.CHAMPION, two, "a manual train-model")
    assert info.value.current == one and registry.alias_version("digits", registry.CHAMPION) == one
    promoted = registry.set_alias("digits", registry.CHAMPION, three, "canary passed", rollout_holder=ROLLOUT)
    assert promoted.previous == one and registry.alias_move("digits", registry.CHAMPION) == promoted
    assert leases.read(registry.rollout_lease_uri("digits")) == held, "the rollout's lease is untouched"

    assert leases.release(held)
    moved = registry.set_alias("digits", registry.CHAMPION, two, "after the rollout")
    assert moved.previous == three
    after = leases.try_acquire(registry.rollout_lease_uri("digits"), "the next rollout", ttl_s=60)
    assert after is not None, "the move gave the lease back"


def test_a_rollout_that_lost_its_lease_moves_no_champion(local_storage: str) -> None:
    one, two = _versions(2)
    registry.set_alias("digits", registry.CHAMPION, one, "first")
    assert leases.try_acquire(registry.rollout_lease_uri("digits"), "another rollout", ttl_s=60) is not None
    with pytest.raises(LeaseLost, match="another rollout"):
        registry.set_alias("digits", registry.CHAMPION, two, "canary passed", rollout_holder=ROLLOUT)
    assert registry.alias_version("digits", registry.CHAMPION) == one


def test_a_gate_whose_champion_moved_meanwhile_is_judged_again(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train-model gates v<cand> against v<old>; a rollout promotes v<new> meanwhile: the candidate is judged
    against v<new> (and here loses), never made champion on a decision against a champion that is gone."""
    old = registry.get_version("digits", _register_scored(0.95))
    new = _register_scored(0.99)
    candidate = registry.get_version("digits", _register_scored(0.97))
    registry.set_alias("digits", registry.CHAMPION, old.version, "first")
    real_gate = registry.gate
    pending = [new]

    def gate_then_a_rollout_promotes(*args: object, **kwargs: object) -> registry.GateDecision:
        decision = real_gate(*args, **kwargs)  # type: ignore[arg-type]
        if pending:
            registry.set_alias("digits", registry.CHAMPION, pending.pop(), "canary passed")
        return decision

    monkeypatch.setattr(registry, "gate", gate_then_a_rollout_promotes)
    decision, moves, _ = promotion.gate_and_move(
        "digits", candidate, answers_at(0.97), GateOptions(margin=0.0, floor=0.9)
    )
    assert not decision.promoted and decision.champion == new and "does not beat champion v" in decision.reason
    assert moves == [] and registry.alias_version("digits", registry.CHAMPION) == new


def _register_scored(accuracy: float) -> int:
    """A version judged on the same test split as the others (same data hash): no evaluation needed."""
    return _register(state_dict_bytes(build_model(ModelSpec(width=4))), accuracy).version
