"""Helpers of the tests: loopback services started and stopped by PID.

The services themselves (a moto S3 server, the fault-injecting proxy in
front of it, free ports, stopping a process group) are the benchmarks'
(``rayline/testing/s3_server.py``, ``rayline/testing/fault_proxy.py``): tests may build on
``bench``, never the other way round, so one copy serves both.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rayline.testing.fault_proxy_control import FaultProxy
from rayline.testing.fault_proxy_control import fault_proxy as proxy_in_front
from rayline.testing.s3_server import S3_ENV as S3_TEST_ENV
from rayline.testing.s3_server import (
    create_bucket,
    free_port,
    free_ports,
    process_cpu_seconds,
    s3_server,
    stop_process,
    wait_for_http,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "REPO_ROOT",
    "S3_TEST_ENV",
    "FaultProxy",
    "create_bucket",
    "delete_bucket",
    "free_port",
    "node_port_flags",
    "pids_mentioning",
    "process_cpu_seconds",
    "proxy_in_front",
    "s3_server",
    "start_ray_head",
    "stop_process",
    "wait_for_http",
    "wait_for_port",
]


def delete_bucket(endpoint: str, name: str) -> None:
    import boto3

    bucket = boto3.resource("s3", endpoint_url=endpoint, region_name="us-east-1").Bucket(name)
    bucket.objects.all().delete()
    bucket.delete()


def wait_for_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def pids_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def node_port_flags() -> list[str]:
    """``ray start`` flags giving each of a node's own servers a distinct free loopback port."""
    names = (
        "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
        "ray-client-server-port",
    )  # fmt: skip
    return [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)), strict=True)]


def start_ray_head(make_args: Callable[[], list[str]], env: dict[str, str], temp_dir: Path) -> subprocess.Popen[bytes]:
    """``ray start --head --block`` once it says the runtime started; started again (twice at most) if it exits.

    Its GCS port opens before the rest of the node is up, and on a loaded machine the start can fail by
    itself after that ("The current node timed out during startup": the raylet gave up waiting for its
    agent), which left a dead head behind an open-looking port and every test waiting for its timeout.
    That is the test's machinery failing, not what is under test, so it is retried here, with the
    arguments ``make_args`` gives afresh: a port another process took meanwhile is not asked for again.
    """
    for attempt in range(3):
        args = make_args()
        out = temp_dir / f"head-start-{attempt}.log"
        with out.open("wb") as log:
            head = subprocess.Popen(
                args, env=env, cwd=temp_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 180
        while head.poll() is None and b"Ray runtime started" not in out.read_bytes():
            assert time.monotonic() < deadline, f"the head did not start in 180 s: {out.read_text()[-2000:]}"
            time.sleep(0.2)
        if head.poll() is None:
            return head
        stop_process(head, timeout_s=30)  # what it left of its group
    raise AssertionError(f"the head failed to start three times: {out.read_text()[-2000:]}")


def debian_tool(command: str, package: str) -> str:
    """``command``'s path; a failure under CI (``.ci/run`` installs ``package`` with apt), else a skip."""
    found = shutil.which(command)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{command} is missing: .ci/run installs it (apt-get install {package})")
        pytest.skip(f"needs {command} (apt-get install {package})")
    return found
