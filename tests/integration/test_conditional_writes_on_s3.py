"""Leases, conditional writes and Delta commits on the S3-protocol server (moto): smoke tests, and an
endpoint that ignores conditional writes (the fault proxy strips their headers), refused before any write.

Atomicity is proved on local disk by the unit tests (tests/unit/test_leases.py,
tests/unit/test_predictions_table.py: real processes and threads racing). moto
checks the conditions but writes without a lock, so these only check that the
same calls work over the S3 protocol, through the session's S3 server.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torchvision
from typer.testing import CliRunner

from rayline import storage
from rayline.cli import app
from rayline.errors import ConditionalWritesUnsupported, LeaseLost, NightCommittedElsewhere
from rayline.storage import conditional, layout, leases
from rayline.tables import delta_tables, prediction_reads, predictions_table
from rayline.testing.fault_proxy_control import FaultProxy
from rayline.testing.s3_server import boto3_client
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

    def commit(run: str) -> delta_tables.NightCommit | NightCommittedElsewhere:
        start.wait()
        target = other[1] if run == "run-o1" else night
        try:
            return predictions_table.commit_night(table, files[run], target, run, SCHEMA, expected_seq=seen)
        except NightCommittedElsewhere as exc:
            return exc

    with ThreadPoolExecutor(len(files)) as pool:
        outcomes = dict(zip(files, pool.map(commit, files), strict=True))
    assert isinstance(outcomes.pop("run-o1"), delta_tables.NightCommit), "another night commits on its own"
    assert all(isinstance(o, delta_tables.NightCommit | NightCommittedElsewhere) for o in outcomes.values())
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


def _keys(bucket: str) -> list[str]:
    listed = boto3_client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(str(o["Key"]) for o in listed)


def test_a_command_on_an_endpoint_that_ignores_conditional_writes_fails_at_once_and_writes_nothing(
    s3_faults: FaultProxy, s3_storage: str, prefect_api: str, tmp_path: Path
) -> None:
    """The proxy forwards every write without If-None-Match / If-Match, as a gateway that ignores them would
    answer: register-model's first conditional write (its version claim) probes the endpoint and refuses."""
    weights = tmp_path / "tiny.pt"
    torch.save(torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=2).state_dict(), weights)
    classes = tmp_path / "classes.txt"
    classes.write_text("cat\ndog\n")
    bucket, _ = storage.split_s3(s3_storage)
    s3_faults.configure(strip_conditional=True)
    result = CliRunner().invoke(
        app,
        ["register-model", "--name", "photos", "--arch", "mobilenet_v3_small", "--weights", str(weights),
         "--classes", str(classes)],
    )  # fmt: skip
    out = result.output + (str(result.exception) if result.exception else "")
    assert result.exit_code != 0, out
    said = " ".join(out.split())  # the terminal wraps the message
    assert f"the S3 endpoint {s3_faults.endpoint} (bucket {bucket}) ignores If-None-Match" in said, out
    assert "and If-Match" in said and "Upgrade the server" in said and "locking provider" in said, out
    # nothing but the failed run's own lineage records (START, FAIL): no claim, no weights, no probe left behind
    records = [k for k in _keys(bucket) if k.startswith("root/lineage/")]
    assert _keys(bucket) == records, _keys(bucket)
    assert all(any(f"-{event}-" in k for k in records) for event in ("START", "FAIL")), records
    with pytest.raises(ConditionalWritesUnsupported, match="ignores If-None-Match"):  # answered from memory
        leases.try_acquire(storage.join(s3_storage, "x.lease"), "run-a", ttl_s=60)
    table = layout.table_uri(s3_storage, layout.PREDICTIONS_TABLE)
    with pytest.raises(ConditionalWritesUnsupported):  # delta-rs commits by put-if-absent too
        predictions_table.commit_night(table, [], delta_tables.Night("resnet", DT), "run-a", SCHEMA)
    assert _keys(bucket) == records
