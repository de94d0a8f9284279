"""Leases in storage: exactly one holder, renewal, takeover only after expiry.

Atomicity is proved on local disk with real processes racing; the S3-protocol
server (moto) checks the conditions but writes without a lock, so the S3 test
is a smoke test of the same calls, in the integration tier
(tests/integration/test_conditional_writes_on_s3.py).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from multiprocessing.pool import Pool
from pathlib import Path

import pytest

from rayline import storage
from rayline.errors import ConfigError, LeaseBusy, LeaseLost, StaleFence
from rayline.storage import conditional, fencing, leases

pytestmark = pytest.mark.unit

RACERS = 3
URIS = 30  # leases raced per round: more chances for the racers to collide
SLOT_S = 0.01


def _race(uris: list[str], holder: str, start_at: float) -> list[str]:
    """In a worker process: try to take every lease, each at its own instant; the URIs this holder won.

    All racers try lease k at ``start_at + k * SLOT_S``, so every lease is
    contended (trying them one after another, the fastest racer would be first
    at every one).
    """
    won = []
    for k, uri in enumerate(uris):
        while time.time() < start_at + k * SLOT_S:
            pass  # spin rather than sleep: the racers leave the line within microseconds
        if leases.try_acquire(uri, holder, ttl_s=60) is not None:
            won.append(uri)
    return won


def _warm() -> None:
    """In a worker process: import everything before the race starts."""
    leases.read("/nonexistent/lease")


@pytest.fixture(scope="module")
def racers() -> Iterator[Pool]:
    pool = multiprocessing.get_context("spawn").Pool(RACERS)
    pool.starmap(_warm, [()] * RACERS)
    yield pool
    pool.close()
    pool.join()


def _run_race(pool: Pool, uris: list[str]) -> dict[str, list[str]]:
    start_at = time.time() + 0.3
    won = pool.starmap(_race, [(uris, f"racer-{i}", start_at) for i in range(RACERS)])
    winners: dict[str, list[str]] = {uri: [] for uri in uris}
    for i, uris_won in enumerate(won):
        for uri in uris_won:
            winners[uri].append(f"racer-{i}")
    return winners


def test_processes_racing_for_new_leases_one_wins_each(racers: Pool, tmp_path: Path) -> None:
    uris = [str(tmp_path / f"out-{i}.lease") for i in range(URIS)]
    winners = _run_race(racers, uris)
    assert all(len(w) == 1 for w in winners.values()), winners
    for uri, (winner,) in winners.items():
        assert (lease := leases.read(uri)) is not None and lease.holder == winner and lease.generation == 1


def test_processes_racing_to_take_over_expired_leases_one_wins_each(racers: Pool, tmp_path: Path) -> None:
    uris = [str(tmp_path / f"out-{i}.lease") for i in range(URIS)]
    for uri in uris:
        assert leases.try_acquire(uri, "crashed", ttl_s=-1) is not None  # expired at once: as if it crashed
    winners = _run_race(racers, uris)
    assert all(len(w) == 1 for w in winners.values()), winners
    for uri, (winner,) in winners.items():
        assert (lease := leases.read(uri)) is not None and lease.holder == winner and lease.generation == 2


def test_a_live_lease_is_not_taken_and_its_holder_re_enters(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    first = leases.try_acquire(uri, "run-a", ttl_s=60, describe="dataset x")
    assert first is not None and first.guards == "dataset x" and first.is_live()
    assert leases.try_acquire(uri, "run-b", ttl_s=60) is None
    again = leases.try_acquire(uri, "run-a", ttl_s=60)
    assert again is not None and again.generation == 2, "a retried run takes its own lease again"
    with pytest.raises(LeaseLost):
        leases.renew(first)  # that older write of run-a's is no longer the lease


def test_renew_extends_and_changes_the_token(tmp_path: Path) -> None:
    lease = leases.try_acquire(str(tmp_path / "x.lease"), "run-a", ttl_s=0.5)
    assert lease is not None
    renewed = leases.renew(lease, ttl_s=60)
    assert renewed.token != lease.token and renewed.generation == 2 and renewed.expires_in() > 50
    assert leases.read(lease.uri) == renewed


def test_a_renewal_that_landed_unanswered_is_not_taken_for_a_lost_lease(tmp_path: Path) -> None:
    lease = leases.try_acquire(str(tmp_path / "x.lease"), "run-a", ttl_s=60)
    assert lease is not None
    landed = leases.renew(lease)  # its answer "lost": the holder goes on with the older lease
    again = leases.renew(lease)
    assert again.generation == landed.generation + 1 and leases.read(lease.uri) == again
    taken = leases.try_acquire(str(tmp_path / "y.lease"), "run-a", ttl_s=-1)
    assert taken is not None
    other = leases.try_acquire(taken.uri, "run-b", ttl_s=60)  # a takeover is still a loss
    assert other is not None
    with pytest.raises(LeaseLost):
        leases.renew(taken)


def test_a_lease_taken_over_after_expiry_is_lost_to_its_old_holder(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    paused = leases.try_acquire(uri, "run-a", ttl_s=-1)  # its holder paused past the expiry
    assert paused is not None
    taker = leases.try_acquire(uri, "run-b", ttl_s=60)
    assert taker is not None
    with pytest.raises(LeaseLost, match="run-a lost its lease .* now held by run-b"):
        leases.renew(paused)
    assert not leases.release(paused), "release never touches someone else's lease"
    assert leases.read(uri) == taker
    assert leases.try_acquire(uri, "run-c", ttl_s=60) is None


def test_the_fencing_token_stays_through_renewals_and_rises_with_every_acquisition(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    first = leases.try_acquire(uri, "run-a", ttl_s=-1)  # expires at once: run-a paused past its ttl
    assert first is not None and first.fencing_token() == fencing.Fence(storage.normalize(uri), 1, "run-a")
    renewed = leases.renew(leases.renew(first, ttl_s=-1), ttl_s=-1)
    assert renewed.generation == 3 and renewed.fencing_token() == first.fencing_token()
    taken = leases.try_acquire(uri, "run-b", ttl_s=60)
    assert taken is not None and taken.fence == 4 > renewed.generation, "newer than every write of run-a"
    assert leases.read(uri) == taken, "the fence is stored with the lease"
    assert leases.release(taken)
    again = leases.try_acquire(uri, "run-a", ttl_s=60)
    assert again is not None and again.fence == 6


def test_a_receiver_refuses_an_older_fence_and_remembers_the_newest() -> None:
    seen: dict[str, fencing.Fence] = {}
    old, new = fencing.Fence("s3://b/x.lease", 3, "run-a"), fencing.Fence("s3://b/x.lease", 7, "run-b")
    assert fencing.admit(seen, old, "moving") and fencing.admit(seen, new, "moving")
    assert not fencing.admit(seen, new, "moving") and not fencing.admit(seen, None, "an operator's move")
    with pytest.raises(StaleFence, match=r"moving refused: run-a holds generation 3 .* run-b .* generation 7"):
        fencing.admit(seen, old, "moving")
    assert seen == {"s3://b/x.lease": new}
    assert fencing.admit(seen, fencing.Fence("s3://b/y.lease", 1, "run-c"), "moving"), "each lease its own"


def test_release_lets_the_next_run_in(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    lease = leases.try_acquire(uri, "run-a", ttl_s=60)
    assert lease is not None and leases.release(lease)
    current = leases.read(uri)
    assert current is not None and current.released and not current.is_live()
    assert leases.try_acquire(uri, "run-b", ttl_s=60) is not None
    with pytest.raises(LeaseLost):
        leases.renew(lease)


def test_conditional_writes_on_local_disk(tmp_path: Path) -> None:
    uri = str(tmp_path / "deep" / "claim")
    token = conditional.create_exclusive(uri, b"one")
    assert token is not None and conditional.create_exclusive(uri, b"two") is None
    assert conditional.replace_if_match(uri, b"three", "stale") is None
    assert (new := conditional.replace_if_match(uri, b"three", token)) is not None
    assert conditional.read_versioned(uri) == conditional.Versioned(b"three", new)
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == [".claim.lock", "claim"], "no temp files left"


def test_held_renews_while_the_block_runs(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    with leases.held(uri, "run-a", ttl_s=0.6, wait_s=0) as held:
        for _ in range(6):  # 1.2 s: twice the ttl
            time.sleep(0.2)
            assert leases.try_acquire(uri, "run-b", ttl_s=60) is None
        assert held.lease.generation > 3, "renewed every ttl/3"
        assert held.ensure_held().holder == "run-a"
    current = leases.read(uri)
    assert current is not None and current.released


def test_a_waiter_gets_the_lease_once_it_is_released(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    got: list[leases.HeldLease] = []

    def wait() -> None:
        with leases.held(uri, "run-b", ttl_s=60, wait_s=5, poll_max_s=0.1) as held:
            got.append(held)

    with leases.held(uri, "run-a", ttl_s=60, wait_s=0):
        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)
        assert not got, "run-a still holds it"
    waiter.join(5)
    assert len(got) == 1 and got[0].lease.holder == "run-b" and got[0].waited_s >= 0.25


def test_a_waiter_times_out_naming_the_holder(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    assert leases.try_acquire(uri, "flow run keen-fox on host-1 pid 7", ttl_s=60, describe="dataset x") is not None
    started = time.monotonic()
    with pytest.raises(
        LeaseBusy,
        match=r"holds dataset x at .*\(holder flow run keen-fox on host-1 pid 7, expires in 60 s\); waited 0\.[34]",
    ) as caught:
        with leases.held(uri, "run-b", ttl_s=60, wait_s=0.3, poll_max_s=0.1):
            pytest.fail("the block must not run")
    assert caught.value.holder == "flow run keen-fox on host-1 pid 7"
    assert time.monotonic() - started < 1.0


def test_a_holder_that_lost_its_lease_cannot_commit_and_leaves_the_new_one(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    with leases.held(uri, "run-a", ttl_s=0.2, wait_s=0, renew_every_s=60) as held:  # its renewer "paused"
        time.sleep(0.3)
        taker = leases.try_acquire(uri, "run-b", ttl_s=60)
        assert taker is not None
        with pytest.raises(LeaseLost, match="now held by run-b"):
            held.ensure_held()
    assert leases.read(uri) == taker, "leaving the block released nothing of run-b's"


def test_the_renewer_that_finds_the_lease_taken_over_tells_the_holder_once(tmp_path: Path) -> None:
    uri = str(tmp_path / "x.lease")
    told: list[LeaseLost] = []
    # the renewer first runs after the ttl (as after a pause), once run-b has taken the lease over
    with leases.held(uri, "run-a", ttl_s=0.2, wait_s=0, renew_every_s=0.6) as held:
        held.on_lost(told.append)
        time.sleep(0.3)
        assert not told and leases.try_acquire(uri, "run-b", ttl_s=60) is not None
        deadline = time.monotonic() + 5
        while not told and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(told) == 1 and "now held by run-b" in str(told[0])
        assert held.lost() is not None and len(told) == 1, "told once"
        late: list[LeaseLost] = []
        held.on_lost(late.append)
        assert len(late) == 1, "a callback added after the loss is called at once"


def test_a_paused_holder_nobody_took_over_holds_again(tmp_path: Path) -> None:
    with leases.held(str(tmp_path / "x.lease"), "run-a", ttl_s=0.2, wait_s=0, renew_every_s=60) as held:
        time.sleep(0.3)
        assert held.ensure_held().is_live(), "the swap proves nobody wrote the lease meanwhile"


def test_a_lease_written_before_generations_is_honoured_then_taken_over(tmp_path: Path) -> None:
    uri = str(tmp_path / "rollout.lease")
    storage.write_json_atomic(uri, {"holder": "old-run", "expires_at": time.time() + 60})
    assert leases.try_acquire(uri, "run-a", ttl_s=60) is None
    storage.write_json_atomic(uri, {"holder": "old-run", "expires_at": time.time() - 1})
    taker = leases.try_acquire(uri, "run-a", ttl_s=60)
    assert taker is not None and taker.generation == taker.fence == 1


def test_held_needs_a_positive_ttl(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="positive ttl"):
        with leases.held(str(tmp_path / "x.lease"), "run-a", ttl_s=0, wait_s=0):
            pytest.fail("the block must not run")


def test_run_holder_names_the_run_host_and_process() -> None:
    holder = leases.run_holder("flow run keen-fox (1234)")
    assert holder.startswith("flow run keen-fox (1234) on ") and " pid " in holder
