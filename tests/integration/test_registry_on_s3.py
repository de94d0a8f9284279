"""The registry's conditional writes on the S3-protocol server, and its retries under throttling.

moto checks If-Match / If-None-Match but writes without a lock, so the race
here is one fixed interleaving (the other writer moves the alias between
this mover's read and its swap); racing threads prove atomicity on local disk
(tests/unit/test_alias_moves.py).
"""

from __future__ import annotations

import threading
import time

import pytest

from rayline.errors import AliasConflict, TransientStorageError, is_transient
from rayline.models import registry
from rayline.ray_workloads.serving import canary
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.storage import layout, leases
from rayline.testing.fault_proxy_control import FaultProxy
from tests.unit.test_alias_moves import ROLLOUT, _move_after_the_next_alias_read, _versions
from tests.unit.test_registry_and_models import _register_keyed

pytestmark = pytest.mark.integration


def test_an_alias_moved_between_a_movers_read_and_its_swap_is_not_overwritten_on_s3(
    s3_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two, three = _versions(3)
    registry.set_alias("digits", registry.CHALLENGER, one, "first")
    other: list[registry.AliasMove] = []
    _move_after_the_next_alias_read(
        monkeypatch, lambda: other.append(registry.set_alias("digits", registry.CHALLENGER, three, "the other"))
    )
    with pytest.raises(AliasConflict, match=f"another writer moved it to v{three}") as info:
        registry.set_alias("digits", registry.CHALLENGER, two, "this mover")
    assert info.value.current == three
    assert other[0].previous == one and registry.alias_move("digits", registry.CHALLENGER) == other[0]
    with pytest.raises(AliasConflict, match=f"now on v{three}"):  # a decision against v<one> is stale
        registry.set_alias("digits", registry.CHALLENGER, two, "gated against v1", expected=one)
    moved = registry.set_alias("digits", registry.CHALLENGER, two, "gated against v3", expected=three)
    assert moved.previous == three and registry.alias_move("digits", registry.CHALLENGER) == moved


def test_a_champion_move_outside_a_rollout_is_refused_while_the_rollout_holds_the_lease_on_s3(
    s3_storage: str,
) -> None:
    one, two, three = _versions(3)
    registry.set_alias("digits", registry.CHAMPION, one, "first")
    held = leases.try_acquire(registry.rollout_lease_uri("digits"), ROLLOUT, ttl_s=60)
    assert held is not None
    with pytest.raises(AliasConflict, match="rollout-of-digits"):
        registry.set_alias("digits", registry.CHAMPION, two, "a manual train-model")
    promoted = registry.set_alias("digits", registry.CHAMPION, three, "canary passed", rollout_holder=ROLLOUT)
    assert promoted.previous == one and registry.alias_version("digits", registry.CHAMPION) == three
    assert leases.release(held)
    assert registry.set_alias("digits", registry.CHAMPION, two, "after the rollout").previous == three


def test_a_throttled_read_of_the_first_attempts_claim_fails_the_retry_instead_of_registering_again(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    """The retry cannot tell whether its first attempt claimed a version: it raises a transient error (Prefect
    retries it) rather than claim a second version for the same registration."""
    first = _register_keyed("run-1")
    s3_faults.configure(always_fail=f"/models/digits/v{first.version}/{layout.CLAIM_FILE}", fault_kinds=["503"])
    with pytest.raises(TransientStorageError, match="SlowDown") as info:
        _register_keyed("run-1")
    assert is_transient(info.value) and s3_faults.stats()["fault_503"] >= 1
    s3_faults.reset()  # the throttling is over: Prefect's retry gets the first attempt's version
    assert _register_keyed("run-1").version == first.version
    assert [v.version for v in registry.list_versions("digits")] == [first.version]


def test_a_rollout_paused_past_its_ttl_before_its_champion_move_leaves_the_champion_that_took_over(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    """Rollout A prepared against champion v1 and holds the rollout lease (not renewed: it is paused); its
    read of the alias is delayed at the proxy past the lease's ttl while rollout B takes the lease over and
    promotes v3. A's move must not land: the registry keeps B's v3 (and A retires nothing from serving)."""
    one, two, three = _versions(3)
    registry.set_alias("digits", registry.CHAMPION, one, "first")
    versions = {v: registry.get_version("digits", v) for v in (one, two)}
    prepared_a = canary.PreparedRollout(
        base_url="http://127.0.0.1:9", incumbent=versions[one], candidate=versions[two], champion=one
    )
    lease_uri = registry.rollout_lease_uri("digits")
    assert leases.try_acquire(lease_uri, "rollout A", ttl_s=1.0) is not None
    s3_faults.configure(latency_ms=2500, latency_regex=r"/aliases/champion\.json$")
    outcome: list[object] = []

    def promote_a() -> None:
        try:
            outcome.append(canary.promote(prepared_a, [], ServeConfig(), "rollout A"))
        except AliasConflict as exc:
            outcome.append(exc)

    a = threading.Thread(target=promote_a)
    a.start()
    deadline = time.monotonic() + 10
    while not s3_faults.stats().get("delayed"):  # A has checked its lease and is reading the alias
        assert time.monotonic() < deadline, "rollout A never read the alias"
        time.sleep(0.02)
    s3_faults.reset()  # B's reads are not delayed; A's read, under way, still is
    with leases.held(lease_uri, "rollout B", ttl_s=30, wait_s=5):  # once A's ttl has passed
        moved = registry.set_alias(
            "digits", registry.CHAMPION, three, "rollout B promoted", expected=one, rollout_holder="rollout B"
        )
    a.join(timeout=20)
    assert isinstance(outcome[0], AliasConflict) and f"not v{one} as when its move to v{two}" in str(outcome[0]), (
        outcome
    )
    assert registry.alias_move("digits", registry.CHAMPION) == moved
