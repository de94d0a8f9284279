"""Helpers shared by tests and benchmarks: loopback services started and stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """End a process we started in its own session, by PID.

    SIGTERM goes to the leader alone so it can stop its children in order;
    whatever of its process group is left after ``timeout_s`` is killed.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout_s)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def s3_server(pid_out: list[int] | None = None) -> Iterator[str]:
    """A real S3-protocol server (moto's server mode) on a free loopback port.

    Runs in its own process so that it neither shares the GIL with the test
    nor is a mock of the client: Ray workers reach it over HTTP like any S3.
    """
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    if pid_out is not None:
        pid_out.append(proc.pid)
    try:
        wait_for_http(f"{endpoint}/moto-api/")
        yield endpoint
    finally:
        stop_process(proc)


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)


def delete_bucket(endpoint: str, name: str) -> None:
    import boto3

    bucket = boto3.resource("s3", endpoint_url=endpoint, region_name="us-east-1").Bucket(name)
    bucket.objects.all().delete()
    bucket.delete()
