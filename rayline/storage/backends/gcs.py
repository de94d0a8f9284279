"""Google Cloud Storage through gcsfs's client (the JSON API): one session, one policy for every request.

The JSON API is what GCS's emulators serve (``STORAGE_EMULATOR_HOST``), so
the same requests are proven here and made against GCS. An object's version
is its *generation*; a conditional write sends ``ifGenerationMatch`` (``0``:
only if there is no object) on a multipart upload, the form whose condition
every server checks. Credentials are Application Default Credentials
(``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's, a metadata server), and
their absence a ``ConfigError`` at once; none against an emulator.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import fsspec.asyn

# gcsfs.core's class, not the package's default: that one asks a gRPC API for every bucket's type, which
# emulators do not serve (60 s timeouts each). Imported here, with the [gcs] extra: store_for says so if missing.
from gcsfs.core import GCSFileSystem
from gcsfs.retry import retry_request

from rayline.errors import ConfigError
from rayline.storage.backends.base import ObjectStore, Page, Stat, StoragePolicy, Versioned, first_cause, split

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

SCHEME = "gs://"
_REFUSED = frozenset({412, 409})


def emulator_host() -> str | None:
    """The emulator GCS's own SDKs are pointed at (``STORAGE_EMULATOR_HOST``), as a URL; None for GCS itself."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if host in ("", "default"):
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def http_status(exc: BaseException) -> int | None:
    from gcsfs.retry import HttpError

    found = first_cause(exc, HttpError)
    return int(found.code) if found is not None else None


class PolicyGCSFileSystem(GCSFileSystem):  # type: ignore[misc]
    """gcsfs's filesystem with the policy's attempts on its own retry loop (fixed at 6 by gcsfs at import)."""

    def __init__(self, *args: Any, attempts: int, **kwargs: Any) -> None:
        self.attempts = attempts
        super().__init__(*args, **kwargs)

    async def _request(self, *args: Any, **kwargs: Any) -> Any:
        request = retry_request(retries=self.attempts)(GCSFileSystem._request.__wrapped__)
        return await request(self, *args, **kwargs)


@lru_cache(maxsize=8)
def _filesystem(emulator: str | None, policy: StoragePolicy) -> AbstractFileSystem:
    # A class of this module's, so that the filesystem pickles by reference to Ray's workers (pyarrow's
    # wrapper of it travels with Ray Data's reads and Train's checkpoints).
    return PolicyGCSFileSystem(
        attempts=policy.max_attempts,
        # Application Default Credentials or nothing: gcsfs's own default would go on to probe the metadata
        # server for 16 s and then fall back to anonymous requests, which a private bucket refuses much later.
        token="anon" if emulator else "google_default",
        endpoint_url=emulator,
        requests_timeout=policy.timeout_s,
        session_kwargs={"conn_timeout": policy.connect_timeout_s},
        skip_instance_cache=True,
        use_listings_cache=False,
    )


class GCSStore(ObjectStore):
    scheme = "gs"

    def __init__(self, policy: StoragePolicy) -> None:
        self.policy, self.emulator = policy, emulator_host()
        self.endpoint = self.emulator
        try:
            self.fs = _filesystem(self.emulator, policy)
        except Exception as exc:
            from google.auth.exceptions import DefaultCredentialsError

            if first_cause(exc, DefaultCredentialsError) is None:
                raise
            raise ConfigError(
                "gs:// storage found no Google credentials: set GOOGLE_APPLICATION_CREDENTIALS to a service "
                "account key file, run `gcloud auth application-default login`, run on GCP with a service "
                f"account, or point STORAGE_EMULATOR_HOST at an emulator ({exc})"
            ) from exc

    def _call(self, method: str, path: str, *args: str, **kwargs: Any) -> Any:
        return fsspec.asyn.sync(self.fs.loop, self.fs._call, method, path, *args, **kwargs)

    def get(self, uri: str) -> Versioned | None:
        bucket, key = split(uri)
        try:
            headers, contents = self._call("GET", "b/{}/o/{}", bucket, key, alt="media")
        except FileNotFoundError:
            return None
        return Versioned(bytes(contents), str(headers["X-Goog-Generation"]))

    def _upload(self, uri: str, data: bytes, **condition: str) -> str:
        """A multipart upload (metadata and bytes in one request); the new generation."""
        bucket, key = split(uri)
        boundary = uuid.uuid4().hex
        head = f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps({'name': key})}\r\n"
        body = (head + f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        body += data + f"\r\n--{boundary}--\r\n".encode()
        _, contents = self._call(
            "POST",
            f"{self.fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
            uploadType="multipart",
            headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
            data=body,
            **condition,
        )
        return str(json.loads(contents)["generation"])

    def put(self, uri: str, data: bytes) -> str:
        return self._upload(uri, data)

    def _put_conditional(self, uri: str, data: bytes, generation: str) -> str | None:
        try:
            return self._upload(uri, data, ifGenerationMatch=generation)
        except (FileExistsError, FileNotFoundError):
            return None  # gcsfs's words for 412 (the condition failed) and 404 (a swap of an object that is gone)
        except Exception as exc:
            if http_status(exc) in _REFUSED:
                return None
            raise

    def put_if_absent(self, uri: str, data: bytes) -> str | None:
        return self._put_conditional(uri, data, "0")

    def put_if_match(self, uri: str, data: bytes, version: str) -> str | None:
        if version == "0":  # GCS reads generation 0 as "no object": no object has it, so nothing matches
            return None
        return self._put_conditional(uri, data, version)

    def delete(self, uri: str) -> None:
        bucket, key = split(uri)
        try:
            self._call("DELETE", "b/{}/o/{}", bucket, key)
        except FileNotFoundError:
            return

    def list_pages(self, prefix_uri: str, *, level: bool = False, after: str = "") -> Iterator[Page]:
        bucket, key = split(prefix_uri)
        base = key if key.endswith("/") or not key else key + "/"  # a prefix given with its slash is taken as is
        params: dict[str, Any] = {"prefix": base, "maxResults": 1000, **({"delimiter": "/"} if level else {})}
        if after:
            params["startOffset"] = base + after  # inclusive: the key itself is dropped below
        while True:
            try:
                page = self._call("GET", "b/{}/o", bucket, json_out=True, **params)
            except FileNotFoundError:
                return  # no such bucket: nothing listed, like a missing folder
            objects = [_stat(item, base) for item in page.get("items", []) if not after or item["name"] > base + after]
            yield Page(objects, [p[len(base) :] for p in page.get("prefixes", [])])
            if not page.get("nextPageToken"):
                return
            params["pageToken"] = page["nextPageToken"]

    def filesystem(self) -> AbstractFileSystem:
        return self.fs

    def delta_options(self) -> dict[str, str]:
        options = self.policy.delta_options()
        if self.emulator:
            options.update({"google_base_url": self.emulator, "google_skip_signature": "true", "allow_http": "true"})
        return options


def _stat(item: dict[str, Any], base: str) -> Stat:
    return Stat(
        str(item["name"])[len(base) :], int(item.get("size") or 0), str(item["generation"]), str(item["updated"])
    )
