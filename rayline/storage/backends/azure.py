"""Azure Blob Storage through adlfs's client (the Azure SDK): ``az://container/prefix``, one policy for every request.

Credentials are the SDK's standard variables, read by adlfs: ``AZURE_STORAGE_CONNECTION_STRING``, or
``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_SAS_TOKEN`` / a service
principal (``AZURE_TENANT_ID``, ``AZURE_CLIENT_ID``, ``AZURE_CLIENT_SECRET``). An object's version is its
ETag; a conditional write sends ``If-None-Match: *`` or ``If-Match``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import suppress
from datetime import UTC, datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import adlfs  # the [azure] extra: store_for says so if missing
import fsspec.asyn

from rayline.storage.backends.base import ObjectStore, Page, Stat, StoragePolicy, Versioned, first_cause, split

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

_REFUSED = frozenset({412, 409})


def http_status(exc: BaseException) -> int | None:
    from azure.core.exceptions import HttpResponseError

    found = first_cause(exc, HttpResponseError)
    return int(found.status_code) if found is not None and found.status_code is not None else None


# The SDK's standard variables adlfs reads: a client is built anew when they change
_CREDENTIAL_VARIABLES = (
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_STORAGE_TENANT_ID",
)


def _filesystem(policy: StoragePolicy) -> AbstractFileSystem:
    return _cached_filesystem(policy, tuple(os.environ.get(name, "") for name in _CREDENTIAL_VARIABLES))


class PolicyAzureBlobFileSystem(adlfs.AzureBlobFileSystem):  # type: ignore[misc]
    """adlfs's filesystem whose service client carries the policy's retries and timeouts: adlfs builds it
    without; this rebuilds it whenever adlfs connects, also in a Ray worker that unpickles the filesystem."""

    def __init__(self, *args: Any, attempts: int, timeout_s: float, connect_timeout_s: float, **kwargs: Any) -> None:
        self.client_policy: dict[str, Any] = {
            "retry_total": attempts - 1,
            # the SDK's exponential retry on the others' schedule (about 1, 3, 5, 9 s), not its 15 s first wait
            "initial_backoff": 1,
            "increment_base": 2,
            "random_jitter_range": 1,
            "connection_timeout": connect_timeout_s,
            "read_timeout": timeout_s,
        }
        super().__init__(*args, **kwargs)

    def do_connect(self) -> None:
        from azure.storage.blob.aio import BlobServiceClient

        super().do_connect()
        given: Any = self.service_client  # type: ignore[has-type]
        self.service_client = BlobServiceClient(
            account_url=given.url, credential=given.credential, **self.client_policy
        )


@lru_cache(maxsize=8)
def _cached_filesystem(policy: StoragePolicy, _variables: tuple[str, ...]) -> AbstractFileSystem:
    return PolicyAzureBlobFileSystem(
        attempts=policy.max_attempts,
        timeout_s=policy.timeout_s,
        connect_timeout_s=policy.connect_timeout_s,
        skip_instance_cache=True,
        use_listings_cache=False,
    )


class AzureStore(ObjectStore):
    scheme = "az"

    def __init__(self, policy: StoragePolicy) -> None:
        self.policy = policy
        self.fs = _filesystem(policy)
        self.endpoint = str(self.fs.service_client.url).rstrip("/")
        self.account = str(self.fs.service_client.account_name)

    def _blob(self, uri: str) -> Any:
        container, key = split(uri)
        return self.fs.service_client.get_blob_client(container, key)

    def _sync(self, coroutine: Any) -> Any:
        async def run() -> Any:
            return await coroutine

        return fsspec.asyn.sync(self.fs.loop, run)

    def get(self, uri: str) -> Versioned | None:
        from azure.core.exceptions import ResourceNotFoundError

        async def download() -> Versioned:
            stream = await self._blob(uri).download_blob()
            return Versioned(bytes(await stream.readall()), str(stream.properties.etag).strip('"'))

        try:
            return self._sync(download())  # type: ignore[no-any-return]
        except ResourceNotFoundError:
            return None

    def _upload(self, uri: str, data: bytes, **condition: Any) -> str:
        answer = self._sync(self._blob(uri).upload_blob(data, **condition))
        return str(answer["etag"]).strip('"')

    def put(self, uri: str, data: bytes) -> str:
        return self._upload(uri, data, overwrite=True)

    def _put_conditional(self, uri: str, data: bytes, **condition: Any) -> str | None:
        try:
            return self._upload(uri, data, **condition)
        except Exception as exc:  # the SDK's refusal may hide in any cause (http_status): the rest is re-raised
            if http_status(exc) in _REFUSED or http_status(exc) == 404:
                return None
            raise

    def put_if_absent(self, uri: str, data: bytes) -> str | None:
        return self._put_conditional(uri, data, overwrite=False)  # the SDK sends If-None-Match: *

    def put_if_match(self, uri: str, data: bytes, version: str) -> str | None:
        from azure.core import MatchConditions

        return self._put_conditional(
            uri, data, overwrite=True, etag=f'"{version}"', match_condition=MatchConditions.IfNotModified
        )

    def delete(self, uri: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        with suppress(ResourceNotFoundError):
            self._sync(self._blob(uri).delete_blob())

    def list_pages(self, prefix_uri: str, *, level: bool = False, after: str = "") -> Iterator[Page]:
        from azure.core.exceptions import ResourceNotFoundError
        from azure.storage.blob.aio import BlobPrefix

        container, base = split(prefix_uri, prefix=True)
        client = self.fs.service_client.get_container_client(container)
        blobs = (
            client.walk_blobs(name_starts_with=base, delimiter="/")
            if level
            else client.list_blobs(name_starts_with=base, results_per_page=1000)
        )
        pages = blobs.by_page()

        async def next_page() -> list[Any] | None:
            try:
                page = await pages.__anext__()
            except StopAsyncIteration:
                return None
            return [item async for item in page]

        while True:
            try:
                items = self._sync(next_page())
            except ResourceNotFoundError:
                return  # no such container: nothing listed
            if items is None:
                return
            found = [item for item in items if not isinstance(item, BlobPrefix)]
            objects = [_stat(item, base) for item in found if not after or str(item["name"]) > base + after]
            prefixes = [str(item.name)[len(base) :] for item in items if isinstance(item, BlobPrefix)]
            yield Page(objects, prefixes)

    def filesystem(self) -> AbstractFileSystem:
        return self.fs

    def delta_options(self) -> dict[str, str]:
        """The account, its key where the SDK holds one (a SAS or an identity is found by delta-rs itself from the
        same standard variables), and the endpoint unless it is Azure's own."""
        options = self.policy.delta_options()
        client = self.fs.service_client
        account_url = str(client.url).rstrip("/")
        options["azure_storage_account_name"] = str(client.account_name)
        key = getattr(client.credential, "account_key", None)
        if key:
            options["azure_storage_account_key"] = str(key)
        if not account_url.endswith(".blob.core.windows.net"):
            options["azure_storage_endpoint"] = account_url
            if account_url.startswith("http://"):
                options["allow_http"] = "true"
        return options


def _stat(item: Any, base: str) -> Stat:
    modified = item.get("last_modified")
    when = modified.astimezone(UTC).isoformat() if isinstance(modified, datetime) else str(modified or "")
    return Stat(str(item["name"])[len(base) :], int(item.get("size") or 0), str(item["etag"]).strip('"'), when)
