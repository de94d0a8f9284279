"""How `rayline up` starts a service and waits for it: its own session and log, its PID file, and a readiness
check that gives up early when the process exits (its log says why)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from rayline.cli.interrupts import uninterrupted
from rayline.cli.service_records import ServiceRecord, record_of, write_record
from rayline.errors import ClusterError

# what one `up` started, oldest first: a failed `up` stops these and nothing else
Started = list[tuple[ServiceRecord, subprocess.Popen[bytes]]]


# a service started and not ready yet: returns once it answers, raises ClusterError if it does not in time
Readiness = Callable[[], None]


def start_service(
    state: Path, started: Started, name: str, command: list[str], env: dict[str, str], url: str
) -> tuple[ServiceRecord, subprocess.Popen[bytes]]:
    log = state / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out, uninterrupted():
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        record = record_of(name, proc.pid, command, url, log)
        started.append((record, proc))  # before its PID file: if writing that fails, the failed `up` still stops it
    write_record(state, record)
    return record, proc


def wait_ready(check: str, ready: bool, record: ServiceRecord, timeout_s: float) -> None:
    if not ready:
        tail = Path(record.log).read_text(errors="replace")[-2000:] if Path(record.log).exists() else ""
        raise ClusterError(
            f"{record.name} did not come up within {timeout_s:.0f} s ({check}); log {record.log}:\n{tail}"
        )


def http_ok(url: str, headers: dict[str, str]) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def until(predicate: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:  # it exited: its log says why
            return False
        time.sleep(0.5)
    return False


def readiness(
    check: str, predicate: Callable[[], bool], record: ServiceRecord, proc: subprocess.Popen[bytes], timeout_s: float
) -> Readiness:
    return lambda: wait_ready(check, until(predicate, proc, timeout_s), record, timeout_s)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports: each socket stays bound until all are chosen, since ports asked
    for one at a time can repeat (Ray refuses a node whose two agents got one)."""
    with contextlib.ExitStack() as bound:
        socks = [bound.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
