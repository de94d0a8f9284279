"""Google Cloud Storage through gcsfs's client (the JSON API): one session, one policy for every request.

The JSON API is what GCS's emulators serve (``STORAGE_EMULATOR_HOST``), so the same requests are proven
here and made against GCS. An object's version is its *generation*; a conditional write sends
``ifGenerationMatch`` (``0``: only if there is no object) on a multipart upload, the form whose condition
every server checks.

Credentials are decided before any request (:func:`google_credentials`), for rayline's client and
delta-rs's alike: a file the user named (``GOOGLE_APPLICATION_CREDENTIALS``) or gcloud's application-default
file, else the metadata server only where the machine says it runs on Google Cloud; otherwise a
``ConfigError`` at once. Nothing is ever asked of the cloud's metadata address on a machine that is not
Google's, and against an emulator nothing is asked for a token at all (:meth:`GCSStore.delta_write_refusal`).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
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

_REFUSED = frozenset({412, 409})


def emulator_host() -> str | None:
    """The emulator GCS's own SDKs are pointed at (``STORAGE_EMULATOR_HOST``), as a URL; None for GCS itself."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if host in ("", "default"):
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


# Set by Google's serverless runtimes (Cloud Run services and jobs, Cloud Functions), whose DMI is not GCE's.
_SERVERLESS_MARKERS = ("K_SERVICE", "CLOUD_RUN_JOB", "FUNCTION_TARGET")
_DMI_PRODUCT = Path("/sys/class/dmi/id/product_name")


@dataclass(frozen=True)
class GoogleCredentials:
    """Where a GCS client's credentials come from: none (an emulator), a credentials file, or the metadata server."""

    source: Literal["emulator", "file", "metadata"]
    path: str | None = None


def on_google_cloud() -> bool:
    """Whether the machine says, without a request, that it runs on Google Cloud: its DMI product name (GCE and
    GKE nodes, as google-auth reads it), a serverless runtime's variables, or a metadata host the user named."""
    if any(os.environ.get(name) for name in ("GCE_METADATA_HOST", "GCE_METADATA_IP", *_SERVERLESS_MARKERS)):
        return True
    try:
        return _DMI_PRODUCT.read_text().strip().startswith("Google")
    except OSError:
        return False


def gcloud_credentials_file() -> Path:
    """gcloud's application-default credentials file (``gcloud auth application-default login`` writes it)."""
    config = os.environ.get("CLOUDSDK_CONFIG") or str(Path.home() / ".config" / "gcloud")
    return Path(config) / "application_default_credentials.json"


def google_credentials() -> GoogleCredentials:
    """The credentials a GCS client uses here, decided without a request (the module docstring's order)."""
    if emulator_host():
        return GoogleCredentials("emulator")
    named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "").strip()
    if named:
        if not os.path.isfile(named):
            raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS names {named}, which is not a file")
        return GoogleCredentials("file", named)
    gcloud = gcloud_credentials_file()
    if gcloud.is_file():
        return GoogleCredentials("file", str(gcloud))
    if on_google_cloud():
        return GoogleCredentials("metadata")
    raise ConfigError(
        "gs:// storage found no Google credentials: set GOOGLE_APPLICATION_CREDENTIALS to a service account key "
        "file, run `gcloud auth application-default login`, run on GCP with a service account (or set "
        "GCE_METADATA_HOST to its metadata server), or point STORAGE_EMULATOR_HOST at an emulator. No request "
        "was made: rayline never asks the cloud's metadata address from a machine that is not Google's"
    )


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


_GCSFS_TOKEN = {"emulator": "anon", "metadata": "cloud"}


@lru_cache(maxsize=8)
def _filesystem(emulator: str | None, credentials: GoogleCredentials, policy: StoragePolicy) -> AbstractFileSystem:
    # A class of this module's, so that the filesystem pickles by reference to Ray's workers (pyarrow's
    # wrapper of it travels with Ray Data's reads and Train's checkpoints).
    return PolicyGCSFileSystem(
        attempts=policy.max_attempts,
        # never gcsfs's own default: it probes the metadata server for 16 s, then falls back to anonymous
        # requests, which a private bucket refuses much later
        token=credentials.path or _GCSFS_TOKEN[credentials.source],
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
        self.credentials = google_credentials()
        try:
            self.fs = _filesystem(self.emulator, self.credentials, policy)
        except (ValueError, OSError) as exc:  # gcsfs's words for a credentials file it cannot use
            raise ConfigError(f"gs:// storage cannot use the credentials file {self.credentials.path}: {exc}") from exc

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
        except Exception as exc:  # the client's refusal may hide in any cause (http_status): the rest is re-raised
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
        with suppress(FileNotFoundError):
            self._call("DELETE", "b/{}/o/{}", *split(uri))

    def list_pages(self, prefix_uri: str, *, level: bool = False, after: str = "") -> Iterator[Page]:
        bucket, base = split(prefix_uri, prefix=True)
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
        elif self.credentials.path:
            options["google_application_credentials"] = self.credentials.path
        return options

    def delta_write_refusal(self) -> str | None:
        if not self.emulator:
            return None
        return (
            f"delta-rs cannot write Delta tables on the GCS emulator at {self.emulator}: it writes through GCS's "
            "XML API, which no GCS emulator serves, and would ask the cloud's metadata address for a token first "
            "(docs/storage.md)"
        )


def _stat(item: dict[str, Any], base: str) -> Stat:
    return Stat(
        str(item["name"])[len(base) :], int(item.get("size") or 0), str(item["generation"]), str(item["updated"])
    )
