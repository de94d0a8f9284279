"""Leases, conditional writes and Delta commits on the S3-protocol server (moto): smoke tests.

Atomicity is proved on local disk by the unit tests (tests/unit/test_leases.py,
tests/unit/test_predictions_table.py: real processes and threads racing). moto
checks the conditions but writes without a lock, so these only check that the
same calls work over the S3 protocol, through the session's S3 server.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rayline import storage
from rayline.errors import LeaseLost, NightCommittedElsewhere
from rayline.storage import conditional, layout, leases
from rayline.tables import delta_tables, prediction_reads, predictions_table
from tests.unit.test_predictions_table import DT, SCHEMA, _labels, _write, errors_landed_predictions_raised

pytestmark = pytest.mark.integration


def test_leases_on_the_s3_protocol_server_smoke(s3_storage: str) -> None:
    """The same calls against the moto server (a smoke test: moto cannot prove atomicity)."""
    uri = storage.join(s3_storage, "leases", "x.lease")
    first = leases.try_acquire(uri, "run-a", ttl_s=60)
    assert first is not None and leases.try_acquire(uri, "run-b", ttl_s=60) is None
    renewed = leases.renew(leases.renew(first))
    assert renewed.token != first.token and leases.read(uri) == renewed
    with pytest.raises(LeaseLost):  # two writes behind: not a renewal whose answer was lost
        leases.renew(first)
    assert leases.release(renewed)
    expired = leases.try_acquire(uri, "run-b", ttl_s=-1)
    assert expired is not None
    taker = leases.try_acquire(uri, "run-c", ttl_s=60)
    assert taker is not None and taker.generation == expired.generation + 1
    with pytest.raises(LeaseLost, match="now held by run-c"):
        leases.renew(expired)
    assert not leases.release(expired) and leases.read(uri) == taker
    claim = storage.join(s3_storage, "claims", "v1")
    assert conditional.create_exclusive(claim, b"a") is not None
    assert conditional.create_exclusive(claim, b"b") is None


def test_commits_on_the_s3_protocol_server_smoke(s3_storage: str) -> None:
    """delta-rs's S3 client on the moto server: a smoke test (moto can't prove atomicity; local disk does)."""
    table = layout.table_uri(s3_storage, layout.PREDICTIONS_TABLE)
    other = [delta_tables.Night("vit", "2026-11-01"), delta_tables.Night("vit", "2026-11-02")]
    predictions_table.commit_night(table, _write(table, other[0], "run-o0", parts=1), other[0], "run-o0", SCHEMA)
    night = delta_tables.Night("resnet", DT)
    seen = predictions_table.night_seq(table, night)
    runs = ["run-x", "run-y", "run-z"]
    files = {run: _write(table, night, run) for run in runs}
    files["run-o1"] = _write(table, other[1], "run-o1", parts=1)
    start = threading.Barrier(len(files))

    def commit(run: str) -> predictions_table.CommitResult | NightCommittedElsewhere:
        start.wait()
        target = other[1] if run == "run-o1" else night
        try:
            return predictions_table.commit_night(table, files[run], target, run, SCHEMA, expected_seq=seen)
        except NightCommittedElsewhere as exc:
            return exc

    with ThreadPoolExecutor(len(files)) as pool:
        outcomes = dict(zip(files, pool.map(commit, files), strict=True))
    assert isinstance(outcomes.pop("run-o1"), predictions_table.CommitResult), "another night commits on its own"
    assert all(isinstance(o, predictions_table.CommitResult | NightCommittedElsewhere) for o in outcomes.values())
    rows = prediction_reads.read_night(table, "resnet", DT)
    assert rows.num_rows == 8 and len(_labels(rows)) == 1, "one run's rows, once"
    for dt, run in (("2026-11-01", "run-o0"), ("2026-11-02", "run-o1")):
        assert _labels(prediction_reads.read_night(table, "vit", dt)) == {run}


def test_vacuum_keeps_the_paired_errors_on_the_s3_protocol_server(s3_storage: str) -> None:
    """The errors commit landed, the predictions commit raised; a vacuum with no retention keeps the pair.

    One case of the unit test's two (local disk), the one with most commits: another run won the predictions.
    """
    night = delta_tables.Night("resnet", DT)
    paired = errors_landed_predictions_raised(s3_storage, night, "another-run-won")
    removed = prediction_reads.vacuum(
        layout.table_uri(s3_storage, layout.ERRORS_TABLE), retention_hours=0, allow_short_retention=True, dry_run=False
    )
    assert not any(f"part-{paired}-" in path for path in removed)
    pair = prediction_reads.read_night_pair(s3_storage, "resnet", DT)
    assert _labels(pair.predictions) == _labels(pair.errors) == {paired} and pair.errors.num_rows == 4
