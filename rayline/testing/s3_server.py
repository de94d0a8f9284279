"""Loopback services the tests and the benchmarks start and stop themselves, by PID: a moto S3 server, free ports.

The one copy of these: tests/support.py builds on it, and so do the benchmarks, which never import ``tests``
(a bench must run without the test suite, and a change to a test helper must not change a figure). moto is a
``dev`` extra: it runs in its own process (``python -m moto.server``), never imported here.
"""

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
from typing import Any

# moto accepts any credentials; boto3 needs some to sign requests
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports. Every socket stays bound until all are chosen: ports asked for one
    at a time can repeat (seen: Ray refused a node whose two agents got one)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def wait_for_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:  # refused, reset, 5xx, timed out: anything means not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """End a process started in its own session: SIGTERM to the leader, then SIGKILL to what is left of its group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout_s)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def s3_server(pid_out: list[int] | None = None) -> Iterator[str]:
    """A real S3-protocol server (moto's server mode) on a free loopback port; yields its endpoint.

    Its own process, so that it shares no GIL with the client and Ray's workers reach it over HTTP like any S3
    (``mock_aws`` would patch only this process). ``pid_out`` receives its PID (to read its CPU time).
    """
    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    if pid_out is not None:
        pid_out.append(proc.pid)
    try:
        wait_for_http(f"{endpoint}/moto-api/")
        yield endpoint
    finally:
        stop_process(proc)


def boto3_client(pool: int = 10) -> Any:
    """A boto3 S3 client for the configured endpoint (``AWS_ENDPOINT_URL``), for tests and benches to seed or
    inspect a bucket at exact keys; rayline itself talks to S3 through ``rayline.storage``."""
    import boto3
    from botocore.config import Config

    from rayline.config import get_settings

    settings = get_settings()
    config = Config(max_pool_connections=pool, retries={"mode": "standard", "total_max_attempts": 3})
    return boto3.client("s3", endpoint_url=settings.aws_endpoint_url, region_name=settings.aws_region, config=config)


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
