"""The fault proxy seen from a test or a bench: start it in its own process, configure it, stop it by PID.

The proxy itself (``fault_proxy.py``) is standard library only and started by path; this side may use rayline.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayline.testing.fault_proxy import CONTROL, ProxyConfig

SERVER = Path(__file__).with_name("fault_proxy.py")


@dataclass(frozen=True)
class FaultProxy:
    """A running proxy: its endpoint (what S3 clients use), its PID, and its control calls."""

    endpoint: str
    pid: int

    def _call(self, method: str, action: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(f"{self.endpoint}{CONTROL}{action}", data=data, method=method)
        with urllib.request.urlopen(request, timeout=10) as answer:
            result: dict[str, Any] = json.loads(answer.read())
        return result

    def configure(self, **changes: Any) -> dict[str, Any]:
        """Change some settings (``ProxyConfig`` fields); the counters carry on."""
        return self._call("POST", "config", changes)

    def reset(self) -> None:
        """No latency, no faults, counters at zero."""
        self._call("POST", "reset", {})

    def release(self) -> None:
        """Let the held requests go on to the server."""
        self._call("POST", "release", {})

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "stats")


@contextlib.contextmanager
def fault_proxy(upstream: str, **config: Any) -> Iterator[FaultProxy]:
    """The proxy in front of ``upstream`` on a free loopback port, in its own process; stopped by PID at the end."""
    from rayline.testing.s3_server import free_port, stop_process, wait_for_http

    ProxyConfig().updated(config)  # a bad setting fails here, not in the child
    port = free_port()
    argv = [sys.executable, str(SERVER), "--upstream", upstream, "--port", str(port), "--config", json.dumps(config)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{endpoint}{CONTROL}stats")
        yield FaultProxy(endpoint, proc.pid)
    finally:
        stop_process(proc)
