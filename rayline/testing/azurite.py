"""Azurite (Microsoft's Azure Blob emulator) on a loopback port the tests and benchmarks start and stop by PID.

Azurite is a Node.js program, not a Python package: it is found (``azurite_binary``) or installed with npm into
``<repo>/.tools/azurite`` (``install_azurite``; ``.ci/run`` does so when npm is there). It runs in its own
session, with its data in a temporary ``--location`` and telemetry off. Clients use its well-known account.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path

from rayline.testing.s3_server import free_port, stop_process

AZURITE_VERSION = "3.37.0"
# The emulator's fixed development account (published in Azurite's README; not a secret).
ACCOUNT_NAME = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# Any version Azurite knows; --skipApiVersionCheck lets newer SDKs through as well.
_API_VERSION = "2021-08-06"
_TOOLS = Path(__file__).resolve().parents[2] / ".tools" / "azurite"


@dataclass(frozen=True)
class AzuriteEndpoint:
    """Where a running Azurite serves blobs, and the account to sign with."""

    blob_endpoint: str  # http://127.0.0.1:<port>/devstoreaccount1 (path-style: the account is the first segment)
    account_name: str
    account_key: str

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account_name};"
            f"AccountKey={self.account_key};BlobEndpoint={self.blob_endpoint};"
        )


def _candidates() -> Iterator[str]:
    """``azurite-blob``: ``$RAYLINE_AZURITE``, else the copy ``install_azurite`` made, else ``PATH`` (under pytest
    only the last two: tests/conftest.py drops ``RAYLINE_*`` variables at start-up)."""
    for candidate in (os.environ.get("RAYLINE_AZURITE"), str(_TOOLS / "node_modules" / ".bin" / "azurite-blob")):
        if candidate and os.access(candidate, os.X_OK):
            yield candidate
    if (found := shutil.which("azurite-blob")) is not None:
        yield found


def azurite_binary() -> str | None:
    """The first of :func:`_candidates`, or None."""
    return next(_candidates(), None)


def runs(binary: str) -> bool:
    """Whether ``binary --version`` works: an install cut short leaves the command without its modules."""
    try:
        return subprocess.run([binary, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def working_azurite() -> str | None:
    """The first ``azurite-blob`` of :func:`_candidates` that runs; None when none does."""
    return next(filter(runs, _candidates()), None)


def install_azurite() -> str:
    """``npm install`` Azurite (pinned) into ``<repo>/.tools/azurite`` (git-ignored); returns ``azurite-blob``."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm not found: Azurite is a Node.js package (install Node.js, or set RAYLINE_AZURITE)")
    _TOOLS.mkdir(parents=True, exist_ok=True)
    argv = [npm, "install", "--prefix", str(_TOOLS), f"azurite@{AZURITE_VERSION}", "--no-audit", "--no-fund"]
    done = subprocess.run([*argv, "--loglevel=error"], capture_output=True, text=True)
    binary = _TOOLS / "node_modules" / ".bin" / "azurite-blob"
    if done.returncode != 0 or not binary.exists() or not runs(str(binary)):
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return str(binary)


@contextlib.contextmanager
def azurite(containers: list[str]) -> Iterator[AzuriteEndpoint]:
    """Azurite's blob service on a free loopback port with ``containers`` created; stopped by PID on exit.
    ``--loose`` and ``--skipApiVersionCheck`` let any SDK's headers and versions through."""
    binary = azurite_binary()
    if binary is None:
        raise RuntimeError("azurite-blob not found: call rayline.testing.azurite.install_azurite() (needs npm)")
    port = free_port()
    endpoint = AzuriteEndpoint(f"http://127.0.0.1:{port}/{ACCOUNT_NAME}", ACCOUNT_NAME, ACCOUNT_KEY)
    with tempfile.TemporaryDirectory(prefix="rayline-azurite-") as tmp:
        log = Path(tmp, "azurite.log")
        argv = [
            binary,
            "--blobHost", "127.0.0.1",
            "--blobPort", str(port),
            "--location", str(Path(tmp, "data")),
            "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry",
        ]  # fmt: skip
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_until_listening(endpoint, proc, log)
            for container in containers:
                create_container(endpoint, container)
            yield endpoint
        finally:
            stop_process(proc)


def _wait_until_listening(endpoint: AzuriteEndpoint, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Retry a signed List Containers until Azurite connects (quoting its log if it never does): it answers
    nothing unsigned with a 2xx (it has no health URL). An HTTP error is an answer: raised at once."""
    deadline = time.monotonic() + 30
    while True:
        try:
            _shared_key_request(endpoint, "GET", "", {"comp": "list"})
            return
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, ConnectionError) as exc:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"Azurite at {endpoint.blob_endpoint} (exit {proc.poll()}):\n{tail}") from exc
            time.sleep(0.1)


def create_container(endpoint: AzuriteEndpoint, name: str) -> None:
    """``PUT <endpoint>/<name>?restype=container``, signed here with the account key: obstore (what rayline's
    tests use for blobs) cannot create containers, and the azure-storage-blob SDK is not a dependency."""
    _shared_key_request(endpoint, "PUT", name, {"restype": "container"})


def _shared_key_request(endpoint: AzuriteEndpoint, method: str, path: str, query: dict[str, str]) -> None:
    """One bodiless request signed with Shared Key (learn.microsoft.com: "Authorize with Shared Key").

    The string to sign is the verb, eleven standard headers (all empty here: no body, no conditions), the
    ``x-ms-*`` headers sorted, then ``/<account><url path>`` and the query parameters sorted, one
    ``\\nname:value`` each. Path-style URLs repeat the account in the path.
    """
    headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": _API_VERSION}
    url_path = f"/{endpoint.account_name}/{path}" if path else f"/{endpoint.account_name}"
    resource = f"/{endpoint.account_name}{url_path}" + "".join(f"\n{k}:{query[k]}" for k in sorted(query))
    to_sign = "\n".join([method, *[""] * 11, *[f"{k}:{headers[k]}" for k in sorted(headers)], resource])
    digest = hmac.new(base64.b64decode(endpoint.account_key), to_sign.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {endpoint.account_name}:{base64.b64encode(digest).decode()}"
    base = endpoint.blob_endpoint.removesuffix(f"/{endpoint.account_name}")
    url = base + url_path + "?" + "&".join(f"{k}={v}" for k, v in query.items())
    # no body (data=None): urllib would otherwise add a Content-Type, one more header to sign
    request = urllib.request.Request(url, headers=headers, method=method)
    with urllib.request.urlopen(request, timeout=10):
        pass


if __name__ == "__main__":
    # .ci/run: `python3 -m rayline.testing.azurite` installs Azurite unless one that runs is found (an install
    # cut short is repaired by installing again); standard library only
    print(f"azurite-blob: {working_azurite() or install_azurite()}")
