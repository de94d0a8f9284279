"""Fault drills on every cloud backend: the fault proxy in front of moto, fake-gcs-server and Azurite.

Each store's client retries throttling, 5xx and resets with the one policy,
whatever the request (reads, listings, writes, conditional writes), and a
conditional write whose answer is lost after the server applied it is
settled by reading back, so that its writer still wins exactly once.
"""

from __future__ import annotations

import io
import os
import re
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayline import storage
from rayline.storage import conditional, conditional_probe
from rayline.storage.backends import store_for
from rayline.testing.fault_proxy_control import FaultProxy
from tests.conftest import EMULATOR_BUCKET
from tests.support import proxy_in_front

pytestmark = pytest.mark.integration

EVERY_METHOD = ["GET", "HEAD", "PUT", "POST", "DELETE"]
TRANSIENT = ["503", "500", "reset"]


@pytest.fixture(scope="module")
def gcs_proxy(gcs_emulator: str) -> Iterator[FaultProxy]:
    with proxy_in_front(gcs_emulator, flavor="gcs") as proxy:
        yield proxy


@pytest.fixture(scope="module")
def azure_proxy(azurite_server: str | None) -> Iterator[FaultProxy]:
    if azurite_server is None:
        pytest.skip("Azurite is not installed: python -m rayline.testing.azurite (needs npm)")
    with proxy_in_front(re.sub(r"(https?://[^/]+).*", r"\1", azurite_server), flavor="azure") as proxy:
        yield proxy


@pytest.fixture(params=["s3", "gcs", "azure"])
def faulty(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FaultProxy]]:
    """A fresh prefix on one backend, every request to it through the fault proxy (no faults yet)."""
    name = f"faults-{uuid.uuid4().hex[:10]}"
    if request.param == "s3":
        proxy: FaultProxy = request.getfixturevalue("s3_faults")
        root = f"s3://{request.getfixturevalue('s3_bucket')}/{name}"
    elif request.param == "gcs":
        proxy = request.getfixturevalue("gcs_proxy")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        root = f"gs://{EMULATOR_BUCKET}/{name}"
    else:
        proxy = request.getfixturevalue("azure_proxy")
        server = re.sub(r"(https?://[^/]+).*", r"\1", request.getfixturevalue("azurite_endpoint"))
        monkeypatch.setenv(
            "AZURE_STORAGE_CONNECTION_STRING",
            os.environ["AZURE_STORAGE_CONNECTION_STRING"].replace(server, proxy.endpoint),
        )
        root = f"az://{EMULATOR_BUCKET}/{name}"
    monkeypatch.setenv("RAYLINE_STORAGE_MAX_ATTEMPTS", "8")
    proxy.reset()
    assert store_for(root).endpoint is not None and proxy.endpoint in str(store_for(root).endpoint)
    yield root, proxy
    proxy.reset()


def test_transient_faults_on_every_kind_of_request_are_retried_by_the_stores_client(
    faulty: tuple[str, FaultProxy],
) -> None:
    root, proxy = faulty
    store = store_for(root)
    proxy.configure(methods=EVERY_METHOD, fault_kinds=TRANSIENT, fault_rate=0.1, seed=3)
    written = {storage.join(root, f"in/{i}.bin"): f"object {i}".encode() for i in range(8)}
    for uri, data in written.items():
        store.put(uri, data)
    listed = [stat.key for page in store.list_pages(storage.join(root, "in")) for stat in page.objects]
    assert listed == sorted(f"{i}.bin" for i in range(8))
    for uri, data in written.items():
        found = store.get(uri)
        assert found is not None and found.data == data
    claim = storage.join(root, "claim")
    created = store.put_if_absent(claim, b"one")
    assert created is not None and store.put_if_absent(claim, b"two") is None
    swapped = store.put_if_match(claim, b"three", created)
    assert swapped is not None and store.put_if_match(claim, b"four", created) is None
    shard, rows = storage.join(root, "shard.parquet"), pa.table({"uri": [f"u{i}" for i in range(500)]})
    buffer = io.BytesIO()
    pq.write_table(rows, buffer, row_group_size=100)
    store.put(shard, buffer.getvalue())
    assert storage.read_parquet([shard]).equals(rows), "the readers' filesystem retries too"
    for uri in written:
        store.delete(uri)
    assert not [stat for page in store.list_pages(storage.join(root, "in")) for stat in page.objects]
    stats = proxy.stats()
    assert stats["faults"] >= 3 and stats["forwarded"] > 20, stats


def test_a_conditional_write_whose_answer_is_lost_after_it_landed_still_wins_exactly_once(
    faulty: tuple[str, FaultProxy],
) -> None:
    """The server applies the write; its answer is cut short; the client's retry then fails its own condition.
    Reading back finds the writer's own bytes: it won, once, and a rival's later write is refused."""
    root, proxy = faulty
    conditional_probe.require_conditional_writes(storage.join(root, "x"))  # probed before any fault
    uri = storage.join(root, "claims/v1.json")
    proxy.configure(methods=["PUT", "POST"], fault_kinds=["truncate"], fail_first_n=1, key_regex="")
    token = conditional.create_exclusive(uri, b'{"owner": "run-a"}')
    assert token is not None, proxy.stats()
    assert proxy.stats()["fault_truncate"] == 1
    proxy.configure(fail_first_n=0)
    assert conditional.create_exclusive(uri, b'{"owner": "run-b"}') is None
    proxy.reset()
    proxy.configure(methods=["PUT", "POST"], fault_kinds=["truncate"], fail_first_n=1)
    swapped = conditional.replace_if_match(uri, b'{"owner": "run-a", "renewed": 1}', token)
    assert swapped is not None and swapped != token, proxy.stats()
    assert proxy.stats()["fault_truncate"] == 1
    proxy.reset()
    assert conditional.replace_if_match(uri, b'{"owner": "run-b"}', token) is None
    current = conditional.read_versioned(uri)
    assert current is not None and (current.data, current.token) == (b'{"owner": "run-a", "renewed": 1}', swapped)
