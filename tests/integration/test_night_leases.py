"""A night's lease changing hands: after a holder that died between its two commits, and after a holder
paused past its ttl. Each object still gets one row, and the run that loses the lease says so.

The same small night as ``test_night_at_scale.py`` (``prediction_tables_support``), on the session's Ray
cluster; the paused holder is a driver process with a cluster of its own (``night_driver``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rayline.ray_workloads.nightly import batch_inference
from rayline.ray_workloads.nightly.batch_inference import InferenceConfig, InferenceResult, new_run_id
from rayline.ray_workloads.nightly.holding import night_lease_uri, night_listings
from rayline.storage import leases
from rayline.tables.delta_tables import Night
from rayline.tables.prediction_reads import read_night_pair
from rayline.tables.predictions_table import night_seq
from tests.integration.helpers import AT_GATE, GATE_OPEN, GatedPredictor, LeaseWaiters
from tests.integration.night_driver import driver_process, wait_for_blocks
from tests.integration.prediction_tables_support import Inputs, make_inputs, night_config, tables_of, written_files

D1 = "2026-11-27"
NIGHT = Night("digits", D1)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(scope="module", name="inputs")
def _inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return make_inputs(tmp_path_factory)


def _short_leased(inputs: Inputs, root: str, label: str, per_task: int) -> InferenceConfig:
    return night_config(inputs, root, D1, label, per_task=per_task).model_copy(update={"lease_ttl_s": 2.0})


def _assert_one_complete_pair(root: str, inputs: Inputs, run_id: str, label: str) -> None:
    pair = read_night_pair(root, "digits", D1)
    assert pair.commit.run_id == run_id
    uris = pair.predictions.column("uri").to_pylist() + pair.errors.column("uri").to_pylist()
    assert sorted(uris) == sorted(inputs.expected), "not one row per input"
    assert set(pair.predictions.column("flow_run_id").to_pylist()) == {label}


def _wait_until(done: Callable[[], bool], what: str, also_alive: Future[Any], timeout_s: float = 120) -> None:
    """Wait until ``done()``; fail if ``also_alive`` (a run in a thread) ends first."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if also_alive.done():
            also_alive.result()  # its error, if it failed
            raise AssertionError(f"the run ended before {what}")
        assert time.monotonic() < deadline, f"not {what} within {timeout_s:g} s"
        time.sleep(0.05)


class _DiedBetweenItsCommits(Exception):
    pass


def test_a_run_that_takes_over_from_a_holder_dead_between_its_two_commits_completes_the_night(
    inputs: Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commits its errors once B waits on the lease, then dies before its predictions commit: B, which read
    the night before A's errors commit, completes the night (reusing A's blocks) instead of skipping it."""
    root = str(tmp_path / "tables")
    tables = tables_of(root)
    a_run = new_run_id()
    b_waits = threading.Event()
    commit_night = batch_inference.commit_night

    def a_dies_between_its_commits(table: str, *args: Any, **kwargs: Any) -> Any:
        if args[2] == a_run:  # files, night, run id, schema
            if table == tables["predictions"]:
                raise _DiedBetweenItsCommits(f"{a_run} died after its errors commit")
            assert b_waits.wait(120), "B never waited on the night's lease"
        return commit_night(table, *args, **kwargs)

    monkeypatch.setattr(batch_inference, "commit_night", a_dies_between_its_commits)
    lease = night_lease_uri(root, NIGHT)
    a_config, b_config = (_short_leased(inputs, root, run, 8).model_copy(update={"holder": run}) for run in "ab")
    with LeaseWaiters() as waiters, ThreadPoolExecutor(2) as pool:
        a = pool.submit(batch_inference.run, a_config, a_run)
        _wait_until(lambda: (held := leases.read(lease)) is not None and held.holder == "a", "held by A", a)
        b = pool.submit(batch_inference.run, b_config)
        waiters.wait_for(1, timeout_s=120)
        b_waits.set()
        with pytest.raises(_DiedBetweenItsCommits):
            a.result(timeout=240)
        assert night_seq(tables["errors"], NIGHT) == 1 and night_seq(tables["predictions"], NIGHT) == 0
        result = b.result(timeout=240)
    assert isinstance(result, InferenceResult), result
    assert result.reused_blocks == result.blocks, "A's blocks were predicted again"
    _assert_one_complete_pair(root, inputs, result.run_id, "b")
    # B's errors commit replaced A's, which no reader pairs with any predictions
    assert (night_seq(tables["errors"], NIGHT), night_seq(tables["predictions"], NIGHT)) == (2, 1)
    assert night_listings(root, NIGHT) == {}


def test_a_driver_paused_past_its_lease_stops_saying_so_and_the_run_that_took_over_commits_the_night(
    inputs: Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's driver is SIGSTOPped mid-night for longer than its lease's ttl; B takes the night over, lists
    it and waits at a gate before reading its listing; A is continued: it finds its lease lost, stops its
    Ray Data run (its actors stall for good otherwise) and fails saying so, without removing B's listing;
    then B predicts and commits the night, once."""
    root = str(tmp_path / "tables")
    a_run = new_run_id()
    monkeypatch.setattr(batch_inference, "PredictorUDF", GatedPredictor)  # B's actors, not A's (another process)
    with driver_process(_short_leased(inputs, root, "a", 8), a_run, stall_after=1) as a, ThreadPoolExecutor(1) as pool:
        wait_for_blocks(a, _short_leased(inputs, root, "a", 8), a_run, written_files, blocks=1)
        os.kill(a.process.pid, signal.SIGSTOP)
        b = pool.submit(batch_inference.run, _short_leased(inputs, root, "b", 8))
        _wait_until(lambda: any(Path(root).glob(f"{AT_GATE}*")), "B's actors at their gate", b)
        os.kill(a.process.pid, signal.SIGCONT)
        try:
            a.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"A went on after losing its lease: {a.output()}")
        assert a.process.returncode != 0 and "lost its lease" in a.output(), a.output()
        Path(root, GATE_OPEN).touch()
        result = b.result(timeout=240)
    assert isinstance(result, InferenceResult)
    _assert_one_complete_pair(root, inputs, result.run_id, "b")
    tables = tables_of(root)
    assert (night_seq(tables["errors"], NIGHT), night_seq(tables["predictions"], NIGHT)) == (1, 1)
    assert night_listings(root, NIGHT) == {}, "A's listing, left by its lost run, is cleared once B committed"
