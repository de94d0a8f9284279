"""Shared fixtures: one S3-protocol server, one Ray cluster and one Prefect API per session.

Start-up costs seconds each (Ray ~6 s, Prefect ~20 s), so every integration
test shares them; each test writes under its own unique prefix.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rayline.config import PROCESS_DEFAULTS
from tests.support import S3_TEST_ENV, FaultProxy, create_bucket, delete_bucket, proxy_in_front, s3_server

# Variables a developer's shell may carry that would point tests at real services.
_FOREIGN = (
    "RAY_ADDRESS",
    "PREFECT_API_URL",
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "STORAGE_EMULATOR_HOST",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "OPENLINEAGE_URL",
    "MLFLOW_TRACKING_URI",
)

# Set before the session's Ray cluster starts, so that its workers have them too.
# Tests that fault every read of an object wait for all the attempts: fewer and shorter than by default.
_TEST_SETTINGS = {
    # 2 attempts a request (6 by default: botocore's backoff waits up to 1+2+4+8+16 s for them)
    "RAYLINE_STORAGE_MAX_ATTEMPTS": "2",
    # the stage's rounds of re-fetching 0.1, 0.2, 0.4 s apart (0.5, 1, 2 s by default)
    "RAYLINE_FETCH_RETRY_DELAY_S": "0.1",
    # every test's fresh version would convert its model to OpenVINO at its first actor or replica (seconds
    # each): tests/unit/test_execution_plan.py covers that backend
    "RAYLINE_PLAN_OPENVINO": "0",
    # and to ONNX Runtime: tests/unit/test_onnx_plan.py covers that one
    "RAYLINE_PLAN_ONNXRUNTIME": "0",
}


# A test's tier is the folder it lives in; its marker (what ``-m unit`` selects) must say the same.
_TESTS = Path(__file__).parent
_TIERS = frozenset({"unit", "integration", "e2e"})
# Each of these starts a service (an S3-protocol server, a Ray cluster, a Prefect API): no unit test asks for one.
_SERVICE_FIXTURES = frozenset(
    {
        "s3_proxy",
        "s3_endpoint",
        "s3_faults",
        "s3_bucket",
        "s3_storage",
        "gcs_emulator",
        "azurite_server",
        "azurite_endpoint",
        "gcs_storage",
        "azure_storage",
        "ray_session",
        "prefect_api",
        "postgres",
    }
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse a test whose tier marker is not its folder's, or a unit test that asks for a service.

    ``make check`` runs ``-m unit`` as the inner loop: a test that starts Ray or an S3 server
    under the ``unit`` marker would slow it down and fail without those services, and a pure
    test marked otherwise would be left out of it. Runs before ``-m`` deselects anything.
    """
    wrong = []
    for item in items:
        parts = item.path.relative_to(_TESTS).parts if item.path.is_relative_to(_TESTS) else ()
        if not parts or parts[0] not in _TIERS:
            continue
        tier = parts[0]
        marked = {m.name for m in item.iter_markers() if m.name in _TIERS}
        if marked != {tier}:
            wrong.append(f"{item.nodeid}: in tests/{tier}/ but marked {sorted(marked) or 'with no tier'}")
        elif tier == "unit" and (services := _SERVICE_FIXTURES.intersection(item.fixturenames)):
            wrong.append(f"{item.nodeid}: a unit test asking for {sorted(services)}, which start services")
    if wrong:
        raise pytest.UsageError("tests in the wrong tier:\n  " + "\n  ".join(wrong))


def pytest_configure(config: pytest.Config) -> None:
    for key in _FOREIGN:
        os.environ.pop(key, None)
    for key in [k for k in os.environ if k.startswith(("RAYLINE_", "OPENLINEAGE"))]:
        os.environ.pop(key)
    os.environ.update(PROCESS_DEFAULTS)
    os.environ.update(S3_TEST_ENV)
    os.environ.update(_TEST_SETTINGS)


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the run with its status once every fixture, report and plugin is done, skipping the interpreter's
    teardown: a full run's pytest (a Ray driver with Ray's, gRPC's and torch's native threads) was seen to die
    of a segfault there, after its summary and after faulthandler was off, failing a run whatever its tests."""
    if (status := config.stash.get(_EXIT_STATUS, None)) is not None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(status)


@pytest.fixture(scope="session")
def s3_proxy() -> Iterator[FaultProxy]:
    """The session's S3-protocol server behind the fault-injecting proxy (no faults unless a test asks).

    Every S3 client of the session, Ray's workers included (they inherit the
    endpoint when the cluster starts), goes through the proxy: a test turns
    faults on for everything at once with the ``s3_faults`` fixture.
    """
    with s3_server() as upstream, proxy_in_front(upstream) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def s3_endpoint(s3_proxy: FaultProxy) -> Iterator[str]:
    os.environ["AWS_ENDPOINT_URL"] = s3_proxy.endpoint
    yield s3_proxy.endpoint
    os.environ.pop("AWS_ENDPOINT_URL", None)


@pytest.fixture
def s3_faults(s3_proxy: FaultProxy, s3_endpoint: str) -> Iterator[FaultProxy]:
    """The session's proxy for a test to configure (``configure(fault_rate=…)``); reset to no faults after it."""
    s3_proxy.reset()
    yield s3_proxy
    s3_proxy.reset()


# The bucket and container the GCS and Azure emulators start with; each test writes under a prefix of its own.
EMULATOR_BUCKET = "rayline-test"


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[str]:
    """fake-gcs-server for the session (GCS's JSON API), found by every GCS client through STORAGE_EMULATOR_HOST."""
    from rayline.testing.gcs_server import fake_gcs_server

    with fake_gcs_server([EMULATOR_BUCKET]) as endpoint:
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint
        yield endpoint
        os.environ.pop("STORAGE_EMULATOR_HOST", None)


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[str | None]:
    """Azurite for the session where it is installed (it needs npm: ``.ci/run`` installs it), else None; found by
    every Azure client through AZURE_STORAGE_CONNECTION_STRING."""
    from rayline.testing.azurite import azurite, azurite_binary

    if azurite_binary() is None:
        yield None
        return
    with azurite([EMULATOR_BUCKET]) as endpoint:
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = endpoint.connection_string
        yield endpoint.blob_endpoint
        os.environ.pop("AZURE_STORAGE_CONNECTION_STRING", None)


@pytest.fixture
def azurite_endpoint(azurite_server: str | None) -> str:
    if azurite_server is None:
        pytest.skip("Azurite is not installed: python -m rayline.testing.azurite (needs npm)")
    return azurite_server


@pytest.fixture(scope="session")
def ray_session(s3_endpoint: str, gcs_emulator: str, azurite_server: str | None) -> Iterator[None]:
    """One embedded Ray cluster for the whole session, started once every store's emulator is set in the
    environment its workers inherit."""
    from rayline import ray_cluster

    ray_cluster.connect()
    yield
    ray_cluster.disconnect()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prefect API (a server subprocess on SQLite) for the session."""
    import prefect.settings
    from prefect.testing.utilities import prefect_test_harness

    results = tmp_path_factory.mktemp("prefect-results")
    updates = {
        prefect.settings.PREFECT_RESULTS_LOCAL_STORAGE_PATH: str(results),
        # events are stored in batches of 20 or every 5 s by default: a test waiting for one event waited that long
        prefect.settings.PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL: 0.5,
    }
    with prefect.settings.temporary_settings(updates=updates):
        with prefect_test_harness(server_startup_timeout=180):
            yield str(prefect.settings.PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server`` on loopback for the session; tests point MLFLOW_TRACKING_URI at it themselves."""
    from tests.mlflow_support import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture
def test_started() -> float:
    """The unix time this test began: events and records older than it belong to earlier tests."""
    return time.time()


@pytest.fixture
def local_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    root = str(tmp_path / "storage")
    monkeypatch.setenv("RAYLINE_STORAGE", root)
    return root


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> Iterator[str]:
    name = f"rayline-test-{uuid.uuid4().hex[:12]}"
    create_bucket(s3_endpoint, name)
    yield name
    delete_bucket(s3_endpoint, name)


@pytest.fixture
def gcs_storage(gcs_emulator: str, monkeypatch: pytest.MonkeyPatch) -> str:
    root = f"gs://{EMULATOR_BUCKET}/root-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("RAYLINE_STORAGE", root)
    return root


@pytest.fixture
def azure_storage(azurite_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    root = f"az://{EMULATOR_BUCKET}/root-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("RAYLINE_STORAGE", root)
    return root


@pytest.fixture
def s3_storage(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> str:
    root = f"s3://{s3_bucket}/root"
    monkeypatch.setenv("RAYLINE_STORAGE", root)
    return root
