from __future__ import annotations

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
    [("gs://bucket", "unsupported scheme"), ("s3://", "names no bucket"), ("  ", "must not be empty")],
)
def test_bad_storage_uri_fails_with_a_clear_message(monkeypatch: pytest.MonkeyPatch, value: str, fragment: str) -> None:
    monkeypatch.setenv("RAYLINE_STORAGE", value)
    with pytest.raises(ConfigError, match=fragment) as info:
        load_settings()
    assert "storage" in str(info.value)


def test_bad_oversubscription_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYLINE_RAY_CPU_OVERSUBSCRIPTION", "0")
    with pytest.raises(ConfigError, match="ray_cpu_oversubscription"):
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
