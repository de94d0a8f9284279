"""The stage's rounds of re-fetching reads that failed transiently (``fetching.retry_transient``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from rayline.errors import ObjectChangedError, StorageAccessDenied, TransientStorageError, is_transient
from rayline.storage import fetching
from rayline.storage.fetching import Fetched

pytestmark = pytest.mark.unit


class Flaky:
    """A fetch whose reads of ``uri`` fail ``failures[uri]`` times with a reset, then succeed; ``missing`` never."""

    def __init__(self, failures: dict[str, int], missing: frozenset[str] = frozenset()) -> None:
        self.failures = failures
        self.missing = missing
        self.calls: list[list[str]] = []
        self.reads: Counter[str] = Counter()

    def __call__(self, uris: list[str]) -> list[Fetched]:
        self.calls.append(list(uris))
        out = []
        for uri in uris:
            self.reads[uri] += 1
            if uri in self.missing:
                out.append(Fetched(None, error=FileNotFoundError(uri)))
            elif self.reads[uri] <= self.failures.get(uri, 0):
                out.append(Fetched(None, error=ConnectionResetError(f"reset reading {uri}")))
            else:
                out.append(Fetched(uri.encode(), etag="e"))
        return out


def test_only_transient_failures_are_fetched_again_and_results_keep_their_order() -> None:
    fetch, waits = Flaky({"b": 2, "d": 1}, missing=frozenset({"c"})), list[float]()
    fetched = fetching.retry_transient(["a", "b", "c", "d"], fetch, [0.5, 1.0, 2.0], sleep=waits.append)
    assert [f.data for f in fetched] == [b"a", b"b", None, b"d"]
    assert isinstance(fetched[2].error, FileNotFoundError), "a missing object stays its own error"
    assert fetch.calls == [["a", "b", "c", "d"], ["b", "d"], ["b"]]
    assert waits == [0.5, 1.0], "no round once nothing transient is left"


def test_still_transient_after_the_last_round_raises_naming_how_many_and_one_of_them() -> None:
    fetch, waits = Flaky({"a": 99, "b": 99, "c": 0}), list[float]()
    with pytest.raises(TransientStorageError, match=r"2 of 3 objects .* after 2 more rounds .* e\.g\. a: ") as info:
        fetching.retry_transient(["a", "b", "c"], fetch, [0.1, 0.2], sleep=waits.append)
    assert is_transient(info.value) and isinstance(info.value.__cause__, ConnectionResetError)
    assert waits == [0.1, 0.2] and fetch.reads == {"a": 3, "b": 3, "c": 1}


def test_no_rounds_means_the_first_transient_failure_fails_the_call() -> None:
    with pytest.raises(TransientStorageError):
        fetching.retry_transient(["a"], Flaky({"a": 1}), [], sleep=lambda _: None)


def test_delays_double_from_the_setting_with_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYLINE_FETCH_RETRIES", "4")
    monkeypatch.setenv("RAYLINE_FETCH_RETRY_DELAY_S", "0.5")
    delays = fetching.fetch_retry_delays()
    assert len(delays) == 4
    for i, delay in enumerate(delays):
        assert 0.25 * 2**i <= delay <= 0.75 * 2**i


def _denied(uri: str) -> BaseException:
    from botocore.exceptions import ClientError

    answer = {"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}
    answer["ResponseMetadata"] = {"HTTPStatusCode": 403}
    return ClientError(answer, "GetObject")  # type: ignore[arg-type]


@pytest.mark.parametrize("error", [_denied, PermissionError], ids=["s3-AccessDenied", "PermissionError"])
def test_a_read_refused_for_permission_fails_the_call_not_the_object(error: Callable[[str], BaseException]) -> None:
    """A policy or credentials fault is the run's, never a property of the sample: no error row for it."""

    def fetch(uris: list[str]) -> list[Fetched]:
        return [Fetched(None, error=error(u)) if u == "b" else Fetched(u.encode(), etag="e") for u in uris]

    with pytest.raises(StorageAccessDenied, match=r"1 of 3 objects refused for want of permission .* e\.g\. b") as info:
        fetching.fetch_checked(["a", "b", "c"], fetch, [0.1], sleep=lambda _: None)
    assert not is_transient(info.value), "a retry minutes later meets the same policy"
    assert info.value.__cause__ is not None


def test_a_missing_object_stays_its_own_error_row_beside_the_permission_check() -> None:
    fetched = fetching.fetch_checked(["a", "c"], Flaky({}, missing=frozenset({"c"})), [], sleep=lambda _: None)
    assert fetched[0].data == b"a" and isinstance(fetched[1].error, FileNotFoundError)


def test_a_read_of_another_version_than_the_listed_one_is_an_object_changed_error() -> None:
    read = Fetched(data=b"new", etag="e2")
    changed = fetching.as_listed(read, "e1")
    assert isinstance(changed.error, ObjectChangedError) and changed.data is None
    assert "e1" in str(changed.error) and "e2" in str(changed.error)  # both versions named in the error row
    assert fetching.as_listed(read, "e2") is read
    unversioned = Fetched(data=b"bytes")  # a read that names no version proves none
    assert isinstance(fetching.as_listed(unversioned, "size-mtime").error, ObjectChangedError)
    failed = Fetched(data=None, error=FileNotFoundError("gone"))
    assert fetching.as_listed(failed, "e1") is failed  # its own error stays
