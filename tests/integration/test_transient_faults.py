"""A transient fault is not a bad image: S3 faults injected by the session's proxy (``rayline/testing/fault_proxy.py``).

Faults hit only the reads of the input objects (``key_regex``): what is
shown is what ingest and nightly inference do with an object whose read
fails, not how each storage library retries its own listings and writes.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ConnectionClosedError

from rayline import storage
from rayline.config import get_settings
from rayline.errors import StorageAccessDenied, TransientStorageError, is_transient
from rayline.models import registry
from rayline.ray_workloads.data import ingest
from rayline.ray_workloads.nightly import batch_inference as bi
from rayline.seed import digit_objects
from rayline.tables.prediction_reads import committed_nights, read_night_pair
from rayline.testing.fault_proxy_control import FaultProxy
from rayline.testing.s3_server import boto3_client
from tests.integration.helpers import register_untrained_champion

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

DAY = "2026-11-28"
MIX = ["503", "500", "reset"]  # MIX[1:]: no SlowDown, for which botocore waits up to 1, 2, 4, 8 s


def _put_many(prefix: str, count: int) -> dict[str, bytes]:
    """``count`` digit PNGs under ``prefix``, written concurrently; URI → bytes."""
    objects = {storage.join(prefix, key): data for key, data in list(digit_objects(32))[:count]}
    client = boto3_client(16)

    def put(item: tuple[str, bytes]) -> None:
        bucket, _, key = item[0][len("s3://") :].partition("/")
        client.put_object(Bucket=bucket, Key=key, Body=item[1])

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, objects.items()))
    return objects


def _ingest(root: str) -> ingest.IngestResult:
    cfg = ingest.IngestConfig(source_uri=storage.join(root, "raw"), output_root=storage.join(root, "ingested"))
    return ingest.run(cfg)


def _ingested_rows(result: ingest.IngestResult) -> dict[str, bytes | None]:
    table = storage.read_parquet(result.read_shard_uris(), columns=["uri", "data", "error_type"])
    uris = table.column("uri").to_pylist()
    assert len(uris) == len(set(uris)), "an object produced more than one row"
    assert table.column("error_type").null_count == table.num_rows, "an error row"
    return dict(zip(uris, table.column("data").to_pylist(), strict=True))


def _night_config(root: str, incoming: str) -> bi.InferenceConfig:
    return bi.InferenceConfig(
        input_uri=incoming, tables_root=root, dt=DAY, model=registry.resolve("digits", "champion"), actors=1
    )


def _night_predictions(root: str) -> dict[str, int]:
    night = read_night_pair(root, "digits", DAY)
    assert night.errors.num_rows == 0, night.errors.to_pylist()[:3]
    uris = night.predictions.column("uri").to_pylist()
    assert len(uris) == len(set(uris)), "an input predicted twice"
    return dict(zip(uris, night.predictions.column("predicted_index").to_pylist(), strict=True))


def test_the_proxy_answers_slowdown_internal_error_and_resets(s3_faults: FaultProxy, s3_storage: str) -> None:
    """Each fault kind reaches an S3 client as real S3 would send it, and each is classified transient."""
    uri = storage.join(s3_storage, "raw", "one.png")
    storage.write_bytes_atomic(uri, b"x")
    bucket, _, key = uri[len("s3://") :].partition("/")
    client = boto3.client(
        "s3", endpoint_url=s3_faults.endpoint, config=Config(retries={"mode": "standard", "total_max_attempts": 1})
    )
    s3_faults.configure(always_fail="one\\.png$", fault_kinds=MIX, latency_ms=5)
    caught = []
    for _ in MIX:  # the kinds in turn
        with pytest.raises((ClientError, ConnectionClosedError)) as info:
            client.get_object(Bucket=bucket, Key=key)
        caught.append(info.value)
    assert [(getattr(e, "response", None) or {}).get("Error", {}).get("Code") for e in caught] == [
        "SlowDown",
        "InternalError",
        None,
    ]
    assert isinstance(caught[2], ConnectionClosedError) and all(is_transient(e) for e in caught)
    assert client.head_object(Bucket=bucket, Key=key)["ContentLength"] == 1, "HEAD is not faulted (methods)"
    stats = s3_faults.stats()
    assert (stats["fault_503"], stats["fault_500"], stats["fault_reset"]) == (1, 1, 1)


def test_the_proxy_refuses_reads_and_cuts_bodies_short(s3_faults: FaultProxy, s3_storage: str) -> None:
    """A 403 reaches the client as S3's AccessDenied; a body cut short as botocore's streaming error, transient."""
    uri = storage.join(s3_storage, "raw", "one.png")
    storage.write_bytes_atomic(uri, b"0123456789" * 10)
    bucket, _, key = uri[len("s3://") :].partition("/")
    client = boto3.client(
        "s3", endpoint_url=s3_faults.endpoint, config=Config(retries={"mode": "standard", "total_max_attempts": 1})
    )
    s3_faults.configure(always_fail="one\\.png$", fault_kinds=["403", "truncate"])
    with pytest.raises(ClientError) as denied:
        client.get_object(Bucket=bucket, Key=key)
    assert denied.value.response["Error"]["Code"] == "AccessDenied" and not is_transient(denied.value)
    answer = client.get_object(Bucket=bucket, Key=key)  # the head arrives whole; the body is short
    with pytest.raises(Exception) as cut:
        answer["Body"].read()
    assert type(cut.value).__name__ in {"ResponseStreamingError", "IncompleteReadError"}, repr(cut.value)
    assert is_transient(cut.value)
    stats = s3_faults.stats()
    assert (stats["fault_403"], stats["fault_truncate"]) == (1, 1)


def test_a_body_cut_short_is_read_again_never_an_error_row(s3_faults: FaultProxy, s3_storage: str) -> None:
    written = _put_many(storage.join(s3_storage, "raw"), 40)
    s3_faults.configure(fail_first_n=1, fault_kinds=["truncate"], key_regex="/raw/\\d/digit-0000[0-2]\\.png$")
    result = _ingest(s3_storage)
    assert s3_faults.stats()["fault_truncate"] == 3
    assert result.fetch_errors == 0 and _ingested_rows(result) == written


def test_reads_refused_by_policy_fail_ingest_and_the_night_and_commit_nothing(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    """An AccessDenied is the run's permission fault, not a bad sample: no error rows committed or cached."""
    register_untrained_champion()
    written = _put_many(storage.join(s3_storage, "raw"), 20)
    incoming = storage.join(s3_storage, "incoming", f"dt={DAY}")
    _put_many(incoming, 20)
    s3_faults.configure(always_fail="/(raw|incoming)/", fault_kinds=["403"])
    with pytest.raises(StorageAccessDenied, match="refused for want of permission") as info:
        _ingest(s3_storage)
    assert not is_transient(info.value)
    ingested = storage.join(s3_storage, "ingested")
    assert not [o for o in storage.list_objects(ingested) if o.key.endswith(ingest.MANIFEST)], "nothing committed"
    with pytest.raises(StorageAccessDenied, match="AccessDenied"):
        bi.run(_night_config(s3_storage, incoming))
    assert committed_nights(s3_storage, "digits") == [], "the night is not committed"

    s3_faults.reset()  # the policy is fixed: the next ingest reads everything, it finds nothing cached
    again = _ingest(s3_storage)
    assert not again.cached and again.fetch_errors == 0 and _ingested_rows(again) == written


def test_ingest_with_five_percent_of_reads_faulted_gives_one_correct_row_per_object(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    written = _put_many(storage.join(s3_storage, "raw"), 600)
    s3_faults.configure(fault_rate=0.05, fault_kinds=MIX, key_regex="/raw/", seed=13)
    result = _ingest(s3_storage)
    stats = s3_faults.stats()
    assert stats["faults"] >= 10 and all(stats[f"fault_{kind}"] for kind in MIX), stats
    assert result.object_count == len(written) and result.fetch_errors == 0
    assert _ingested_rows(result) == written, "every object once, with its bytes"


def test_reads_failing_past_the_clients_attempts_are_retried_by_the_stage(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    """The first reads of 3 objects fail: more than botocore's attempts, so only the stage's rounds save them."""
    attempts = get_settings().storage_max_attempts  # the session's: 2 (6 by default)
    written = _put_many(storage.join(s3_storage, "raw"), 40)
    s3_faults.configure(
        fail_first_n=attempts + 2, fault_kinds=["500", "reset"], key_regex="/raw/\\d/digit-0000[0-2]\\.png$"
    )
    result = _ingest(s3_storage)
    assert s3_faults.stats()["faults"] == 3 * (attempts + 2), "each faulted object was read until it succeeded"
    assert result.fetch_errors == 0 and _ingested_rows(result) == written


def test_reads_that_keep_failing_fail_ingest_as_transient_and_cache_nothing(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    written = _put_many(storage.join(s3_storage, "raw"), 40)
    broken = sorted(written)[:2]
    s3_faults.configure(always_fail="|".join(re.escape(u.rsplit("/", 1)[1]) for u in broken), fault_kinds=MIX[1:])
    with pytest.raises(TransientStorageError, match="2 of .* objects still failed transiently") as info:
        _ingest(s3_storage)
    assert is_transient(info.value)
    ingested = storage.join(s3_storage, "ingested")
    assert not [o for o in storage.list_objects(ingested) if o.key.endswith(ingest.MANIFEST)], "nothing committed"

    s3_faults.reset()  # the outage is over: the next run fetches everything, it finds nothing cached
    again = _ingest(s3_storage)
    assert not again.cached and again.fetch_errors == 0
    assert _ingested_rows(again) == written


def test_a_night_with_five_percent_of_reads_faulted_predicts_every_input_once(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    register_untrained_champion()
    incoming = storage.join(s3_storage, "incoming", f"dt={DAY}")
    written = _put_many(incoming, 300)
    reference = bi.run(_night_config(s3_storage, incoming))  # fault-free: what each input's row must say
    expected = _night_predictions(s3_storage)
    assert set(expected) == set(written) and reference.errors == 0

    s3_faults.configure(fault_rate=0.05, fault_kinds=MIX, key_regex="/incoming/", seed=5)
    result = bi.run(_night_config(s3_storage, incoming))
    assert s3_faults.stats()["faults"] >= 5
    assert result.errors == 0 and result.predictions == len(written) and result.replaced
    assert _night_predictions(s3_storage) == expected


def test_a_night_whose_reads_keep_failing_fails_as_transient_and_commits_nothing(
    s3_faults: FaultProxy, s3_storage: str
) -> None:
    register_untrained_champion()
    incoming = storage.join(s3_storage, "incoming", f"dt={DAY}")
    written = _put_many(incoming, 30)
    s3_faults.configure(always_fail=re.escape(sorted(written)[0].rsplit("/", 1)[1]), fault_kinds=MIX[1:])
    with pytest.raises(TransientStorageError, match="1 of .* objects still failed transiently") as info:
        bi.run(_night_config(s3_storage, incoming))
    assert is_transient(info.value)
    assert committed_nights(s3_storage, "digits") == [], "the night is not committed (no error rows either)"
