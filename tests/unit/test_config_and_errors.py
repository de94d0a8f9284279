from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rayline.config import Settings, load_settings
from rayline.errors import (
    ClusterError,
    ConfigError,
    InputDataError,
    RaylineError,
    TransientStorageError,
    is_transient,
)

pytestmark = pytest.mark.unit


def test_defaults_are_local_and_embedded(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    assert settings.storage == "./rayline-data"
    assert settings.ray_address is None
    assert settings.embedded_num_cpus >= 2


def test_standard_variables_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYLINE_STORAGE", "s3://bucket/prefix/")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6380")
    settings = load_settings()
    assert settings.storage == "s3://bucket/prefix"
    assert settings.aws_endpoint_url == "http://127.0.0.1:9000"
    assert settings.ray_address == "127.0.0.1:6380"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("hdfs://bucket", "unsupported storage URI 'hdfs://bucket': use a local path, s3://"),
        ("s3://", "names no bucket"),
        ("gs://", "names no bucket"),
        ("az:/container/x", r"malformed AZ URI 'az:/container/x': expected az://container\[/prefix\]"),
        ("  ", "must not be empty"),
        ("s3:/bucket/raw", r"malformed S3 URI 's3:/bucket/raw': expected s3://bucket\[/prefix\]"),
    ],
)
def test_bad_storage_uri_fails_with_a_clear_message(monkeypatch: pytest.MonkeyPatch, value: str, fragment: str) -> None:
    monkeypatch.setenv("RAYLINE_STORAGE", value)
    with pytest.raises(ConfigError, match=fragment) as info:
        load_settings()
    assert "RAYLINE_STORAGE: " in str(info.value), "the message names the variable the user set"


def test_one_setting_sets_the_ttl_of_every_data_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    from rayline.ray_workloads.nightly.contract import InferenceConfig
    from rayline.storage.folders import LeasedOutput

    assert LeasedOutput().lease_ttl_s == 120.0 and InferenceConfig.model_fields["lease_ttl_s"].default_factory
    monkeypatch.setenv("RAYLINE_LEASE_TTL_S", "15")
    assert LeasedOutput().lease_ttl_s == 15.0
    assert LeasedOutput(lease_ttl_s=7).lease_ttl_s == 7.0, "an explicit ttl wins"
    monkeypatch.setenv("RAYLINE_LEASE_TTL_S", "0")
    with pytest.raises(ConfigError, match="RAYLINE_LEASE_TTL_S: Input should be greater than 0"):
        LeasedOutput()


def test_bad_oversubscription_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYLINE_RAY_CPU_OVERSUBSCRIPTION", "0")
    with pytest.raises(ConfigError, match="RAYLINE_RAY_CPU_OVERSUBSCRIPTION"):
        load_settings()


class _FakeClientError(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class WorkerCrashedError(Exception):
    """Stands in for ray.exceptions.WorkerCrashedError, matched by name."""


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError("reset"),
        TimeoutError(),
        TransientStorageError("x"),
        ClusterError("x"),
        _FakeClientError("SlowDown"),
        _FakeClientError("503"),
        WorkerCrashedError(),
    ],
)
def test_transient_failures_are_retried(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [ValueError("bad image"), InputDataError("empty"), ConfigError("bad"), _FakeClientError("AccessDenied")],
)
def test_permanent_failures_are_not_retried(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_a_prefect_task_timeout_is_not_retried() -> None:
    from prefect.task_engine import TaskRunTimeoutError

    timed_out = TaskRunTimeoutError("Task run exceeded timeout of 900 second(s)")
    assert isinstance(timed_out, TimeoutError) and not is_transient(timed_out)


def test_cause_chain_is_followed_and_input_errors_win() -> None:
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as inner:
            raise RaylineError("wrapped") from inner
    except RaylineError as outer:
        assert is_transient(outer)
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as inner:
            raise InputDataError("no such prefix") from inner
    except InputDataError as outer:
        assert not is_transient(outer)


def _body_cut_short() -> list[BaseException]:
    """What botocore and urllib3 raise when an S3 answer's body ends before its Content-Length."""
    from http.client import IncompleteRead

    from botocore.exceptions import IncompleteReadError, ResponseStreamingError
    from urllib3.exceptions import ProtocolError

    broken = ProtocolError("Connection broken: IncompleteRead(10 bytes read, 90 more expected)", IncompleteRead(b"x"))
    # each by itself, as it arrives from another process (pickling drops __cause__ and __context__)
    return [IncompleteReadError(actual_bytes=10, expected_bytes=100), ResponseStreamingError(error=broken), broken]


@pytest.mark.parametrize("exc", _body_cut_short(), ids=lambda e: type(e).__name__)
def test_a_body_cut_short_is_transient(exc: BaseException) -> None:
    assert is_transient(exc)


def test_gcs_without_credentials_is_refused_at_once_naming_the_ways_to_give_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Not gcsfs's default (16 s of metadata-server probes, then anonymous requests that a private bucket refuses
    later), and no request at all: a machine that is not Google's is never asked for a metadata server
    (tests/integration/test_no_metadata_requests.py watches the address itself)."""
    from rayline.storage.backends import gcs, store_for

    _no_google_credentials(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match="no Google credentials: set GOOGLE_APPLICATION_CREDENTIALS") as raised:
        store_for("gs://a-private-bucket/photos")
    assert "gcloud auth application-default login" in str(raised.value)
    assert "STORAGE_EMULATOR_HOST" in str(raised.value) and "No request was made" in str(raised.value)
    with pytest.raises(ConfigError, match="no Google credentials"):
        gcs.google_credentials()


def _no_google_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rayline.storage.backends import gcs

    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST", "GCE_METADATA_IP",
                 *gcs._SERVERLESS_MARKERS):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setattr(gcs, "_DMI_PRODUCT", tmp_path / "product_name")  # a machine that is not Google's


def _service_account_key() -> dict[str, str]:
    """A service account key file's fields, with a key of its own (never used for a request here)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return {"type": "service_account", "project_id": "p", "private_key_id": "k", "private_key": key.decode(),
            "client_email": "rayline@p.iam.gserviceaccount.com", "client_id": "1",
            "token_uri": "https://oauth2.googleapis.com/token"}  # fmt: skip


def test_gcs_credentials_are_decided_before_any_request_and_delta_rs_is_given_the_same(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from rayline.storage.backends import gcs, store_for

    _no_google_credentials(monkeypatch, tmp_path)
    adc = tmp_path / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir()
    adc.write_text("{}")
    assert gcs.google_credentials() == gcs.GoogleCredentials("file", str(adc))
    named = tmp_path / "key.json"
    named.write_text("{}")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(named))
    assert gcs.google_credentials() == gcs.GoogleCredentials("file", str(named))
    named.write_text(json.dumps(_service_account_key()))
    store = store_for("gs://a-private-bucket/photos")
    assert (store.delta_options() or {})["google_application_credentials"] == str(named)  # delta-rs: the same file
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="missing.json, which is not a file"):
        gcs.google_credentials()
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS")
    adc.unlink()
    (tmp_path / "product_name").write_text("Google Compute Engine\n")
    assert gcs.google_credentials() == gcs.GoogleCredentials("metadata")
    (tmp_path / "product_name").write_text("Standard PC\n")
    monkeypatch.setenv("K_SERVICE", "predictor")  # Cloud Run
    assert gcs.google_credentials().source == "metadata"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    assert gcs.google_credentials().source == "emulator"


def test_a_settings_file_is_read_under_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``./rayline.toml`` (or ``RAYLINE_CONFIG``) holds settings by name; a variable that is set wins."""
    from rayline.config import get_settings

    for name in ("RAYLINE_STORAGE", "RAYLINE_LEASE_TTL_S", "RAYLINE_CONFIG", "RAYLINE_SERVE_PLAN"):
        monkeypatch.setenv(name, "")  # recorded, so that whatever the file sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rayline.toml").write_text(f'storage = "{tmp_path / "data"}"\nlease_ttl_s = 90.0\nserve_plan = "off"\n')
    monkeypatch.setenv("RAYLINE_LEASE_TTL_S", "30")
    settings = get_settings()
    assert settings.storage == str(tmp_path / "data") and settings.serve_plan == "off"
    assert settings.lease_ttl_s == 30.0, "the environment wins over the file"

    (tmp_path / "other.toml").write_text('storage = "s3://bucket/x"\nstorage_root = "typo"\n')
    monkeypatch.setenv("RAYLINE_CONFIG", str(tmp_path / "other.toml"))
    refused = r"other.toml: storage_root is no rayline setting \(did you mean storage\?\); known: .*storage"
    with pytest.raises(ConfigError, match=refused):
        get_settings()
    monkeypatch.setenv("RAYLINE_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="RAYLINE_CONFIG=.*missing.toml: no such file"):
        get_settings()


# Names no code reads, set on purpose below: the scan of the code base leaves them out.
_MISSPELT = "RAYLINE_SERVE_CPUS_PER_REPLCA"
_FAR_FROM_EVERY_NAME = "RAYLINE_QQQ_XYZZY"
_DELIBERATELY_UNKNOWN = frozenset({_MISSPELT, _FAR_FROM_EVERY_NAME})


@pytest.mark.parametrize(
    ("variable", "meant"),
    [(_MISSPELT, "RAYLINE_SERVE_CPUS_PER_REPLICA"), ("rayline_storge", "RAYLINE_STORAGE")],
)
def test_a_misspelt_variable_is_refused_naming_the_setting_meant(
    monkeypatch: pytest.MonkeyPatch, variable: str, meant: str
) -> None:
    """pydantic-settings ignores a name it does not know: the typo would leave the default in force, unnoticed."""
    from rayline.config import get_settings, setting_variables

    assert meant in setting_variables()
    monkeypatch.setenv(variable, "1")
    refused = rf"^invalid rayline settings: {variable} is no rayline setting \(did you mean {meant}\?\)"
    with pytest.raises(ConfigError, match=refused):
        get_settings()


def test_a_variable_far_from_every_name_is_refused_without_a_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_FAR_FROM_EVERY_NAME, "1")
    with pytest.raises(ConfigError, match=f"{_FAR_FROM_EVERY_NAME} is no rayline setting") as info:
        load_settings()
    assert "did you mean" not in str(info.value) and "docs/configuration.md" in str(info.value)


def test_variables_read_outside_the_settings_and_the_aliases_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    from rayline.config import OUTSIDE_SETTINGS

    for name in [*OUTSIDE_SETTINGS, "RAYLINE_S3_ENDPOINT_URL", "RAYLINE_RAY_ADDRESS"]:
        monkeypatch.setenv(name, "127.0.0.1:1")
    settings = load_settings()
    assert settings.aws_endpoint_url == settings.ray_address == "127.0.0.1:1"


def _names_in_the_code_base() -> dict[str, set[str]]:
    """Every RAYLINE_* name the repository's code, docs and deployment files write, and where."""
    from tests.support import REPO_ROOT

    folders = [".ci", "bench", "deployments", "docs", "flows", "ray_workloads", "rayline", "tasks", "tests"]
    files = [p for f in folders for p in (REPO_ROOT / f).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    files += [REPO_ROOT / name for name in ("Makefile", "README.md", "prefect.yaml", "pyproject.toml")]
    found: dict[str, set[str]] = {}
    for path in files:
        for name in re.findall(r"RAYLINE_[A-Z0-9_]+", path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def test_every_rayline_variable_of_the_code_base_is_a_setting_or_read_outside_them() -> None:
    """A name used anywhere must pass check_variables, or setting it would be refused; ``RAYLINE_SERVE_`` and
    the like are the heads of names built in code. Each name allowed outside the settings is still used."""
    from rayline.config import OUTSIDE_SETTINGS, Settings, setting_variables

    assert not Settings.model_config.get("env_nested_delimiter"), "a nested setting's names: setting_variables"
    known = setting_variables() | OUTSIDE_SETTINGS
    found = _names_in_the_code_base()
    unknown = {
        name: sorted(where)
        for name, where in found.items()
        if name not in known | _DELIBERATELY_UNKNOWN
        and not (name.endswith("_") and any(k.startswith(name) for k in known))
    }
    assert not unknown, f"neither a setting nor in rayline.config.OUTSIDE_SETTINGS: {unknown}"
    stale = sorted(n for n in OUTSIDE_SETTINGS if not found.get(n, set()) - {"rayline/config.py"})
    assert not stale, f"allowed outside the settings but used nowhere: {stale}"


def test_joining_an_address_where_nothing_answers_fails_at_once_naming_it() -> None:
    """A stale RAY_ADDRESS (a head that is down) is refused within RAYLINE_RAY_CONNECT_TIMEOUT_S: Ray's own
    connect retries for about 14 minutes before it gives up. In a process of its own: this one may be connected
    to the session's cluster already, and a connected process does not connect again."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        env = {**os.environ, "RAY_ADDRESS": address, "RAYLINE_RAY_CONNECT_TIMEOUT_S": "1"}
        program = "from rayline import ray_cluster; ray_cluster.connect()"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60
    assert done.returncode != 0
    assert f"ClusterError: could not connect to Ray: nothing accepted a connection at {address} (RAY_ADDRESS)" in (
        done.stderr
    ), done.stderr[-2000:]
