"""HTTP load for bench/serve.py: closed and open loops from Python threads, and saturation by wrk.

Every client posts image bytes as a raw body over kept-alive loopback connections. Latency is
per request on the client (send → whole answer read). A failure is any answer but 200, or a
failed connection.

Saturation (a fixed number of connections for a fixed time, each sending its next request as
soon as the last is answered) runs ``wrk`` when it is on the PATH (Debian's package ``wrk``):
a C client costs the two cores of a small machine far less than Python threads do, and it is
what an on-call engineer points at a service. Without it the same load comes from Python
threads, and the figure says which client made it.
"""

from __future__ import annotations

import http.client
import itertools
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"
PACED_CLIENTS = 16  # connections of the open-loop run: enough that a slow answer never delays a send
# wrk's --latency lines ("     50%   43.04ms") and its totals
_WRK_PERCENTILE = re.compile(r"^\s*(50|75|90|99)%\s+([\d.]+)(us|ms|s)\s*$", re.MULTILINE)
_WRK_REQUESTS = re.compile(r"^\s*(\d+) requests in ([\d.]+)(ms|s|m)", re.MULTILINE)
_WRK_ERRORS = re.compile(
    r"Non-2xx or 3xx responses: (\d+)|Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)"
)
_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


@dataclass
class Run:
    """Latencies (ms) of the answered requests of one run, failures, and its wall time."""

    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0

    def extend(self, other: Run) -> None:
        self.latencies_ms += other.latencies_ms
        self.errors += other.errors
        self.wall_s += other.wall_s

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    @property
    def rps(self) -> float:
        return (len(self.latencies_ms) + self.errors) / self.wall_s if self.wall_s else 0.0

    def line(self, label: str) -> str:
        return (
            f"  {label:<7} p50 {self.percentile(50):7.2f} ms   p99 {self.percentile(99):7.2f} ms   "
            f"{self.rps:7.1f} req/s   errors {self.errors}   ({len(self.latencies_ms) + self.errors} requests)"
        )


@dataclass(frozen=True)
class Saturation:
    """One saturation run: answered requests a second, latency percentiles, failures, and who sent them."""

    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    client: str

    def line(self, label: str) -> str:
        return (
            f"  {label:<7} p50 {self.p50_ms:7.2f} ms   p99 {self.p99_ms:7.2f} ms   {self.rps:7.1f} req/s   "
            f"errors {self.errors}   ({self.requests} requests, {self.client})"
        )


class Client:
    """One kept-alive HTTP connection; reconnects after a failure."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection(HOST, port, timeout=60)

    def post(self, path: str, body: bytes) -> bool:
        try:
            self.conn.request("POST", path, body=body, headers={"Content-Type": "image/png"})
            response = self.conn.getresponse()
            response.read()
            return response.status == 200
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
            return False

    def close(self) -> None:
        self.conn.close()


def closed_loop(
    port: int, path: str, bodies: Sequence[bytes], concurrency: int, requests: int, duration_s: float | None = None
) -> Run:
    """``concurrency`` clients, each sending its next request once the last is answered, until ``requests``
    are sent or (``duration_s`` given) that many seconds have passed."""
    run = Run()
    lock = threading.Lock()
    counter = itertools.count()
    began: list[float] = []  # the clock starts once every client is connected (the barrier's action)
    start = threading.Barrier(concurrency + 1, action=lambda: began.append(time.perf_counter()))

    def more(i: int) -> bool:
        return time.perf_counter() < began[0] + duration_s if duration_s is not None else i < requests

    def client_loop() -> None:
        client = Client(port)
        client.post(path, bodies[0])  # connect before the clock starts
        start.wait()
        latencies: list[float] = []
        errors = 0
        while more(i := next(counter)):
            sent = time.perf_counter()
            ok = client.post(path, bodies[i % len(bodies)])
            if ok:
                latencies.append((time.perf_counter() - sent) * 1000)
            else:
                errors += 1
        client.close()
        with lock:
            run.latencies_ms += latencies
            run.errors += errors

    with ThreadPoolExecutor(concurrency) as pool:
        waiting = [pool.submit(client_loop) for _ in range(concurrency)]
        start.wait()
    for done in waiting:
        done.result()  # a client's error, raised here
    run.wall_s = time.perf_counter() - began[0]
    return run


def open_loop(port: int, path: str, bodies: Sequence[bytes], rate: float, duration_s: float) -> Run:
    """Requests sent at fixed times (``rate`` per second); latency counted from the scheduled time."""
    jobs = iter(range(int(rate * duration_s)))  # next() on it is atomic: each request goes to one client
    run = Run()
    lock = threading.Lock()
    clients = [Client(port) for _ in range(PACED_CLIENTS)]
    for client in clients:
        client.post(path, bodies[0])  # connect before the clock starts
    t0 = time.perf_counter() + 0.1

    def worker(client: Client) -> None:
        while (i := next(jobs, None)) is not None:
            scheduled = t0 + i / rate
            time.sleep(max(0.0, scheduled - time.perf_counter()))
            ok = client.post(path, bodies[i % len(bodies)])
            with lock:
                if ok:
                    run.latencies_ms.append((time.perf_counter() - scheduled) * 1000)
                else:
                    run.errors += 1
        client.close()

    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(worker, clients))
    run.wall_s = time.perf_counter() - t0
    return run


def saturate(port: int, path: str, body: bytes, connections: int, duration_s: float) -> Saturation:
    """``connections`` kept-alive connections posting ``body`` back to back for ``duration_s`` seconds."""
    wrk = shutil.which("wrk")
    if wrk is None:
        run = closed_loop(port, path, [body], connections, 0, duration_s=duration_s)
        answered = len(run.latencies_ms)
        return Saturation(
            answered / run.wall_s, run.percentile(50), run.percentile(99), answered + run.errors, run.errors, "python"
        )
    with tempfile.TemporaryDirectory(prefix="rayline-bench-wrk-") as folder:
        body_file, script = Path(folder) / "body.bin", Path(folder) / "post.lua"
        body_file.write_bytes(body)
        script.write_text(
            'wrk.method = "POST"\n'
            f'local f = io.open("{body_file}", "rb")\n'
            "wrk.body = f:read('*a')\n"
            "f:close()\n"
            'wrk.headers["Content-Type"] = "image/png"\n'
        )
        threads = min(2, connections)
        command = [wrk, f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--latency", "-s", str(script)]
        url = f"http://{HOST}:{port}{path}"
        done = subprocess.run([*command, url], capture_output=True, text=True, check=True, timeout=duration_s + 60)
    return parse_wrk(done.stdout)


def parse_wrk(out: str) -> Saturation:
    """wrk's report (run with ``--latency``) as figures; failures are non-2xx answers and socket errors."""
    percentiles = {int(q): float(v) * _UNIT_MS[unit] for q, v, unit in _WRK_PERCENTILE.findall(out)}
    totals = _WRK_REQUESTS.search(out)
    if totals is None or 50 not in percentiles or 99 not in percentiles:
        raise ValueError(f"wrk's report has no request count or latency distribution:\n{out}")
    requests, wall_s = int(totals.group(1)), float(totals.group(2)) * _UNIT_MS[totals.group(3)] / 1000
    errors = sum(int(n) for match in _WRK_ERRORS.finditer(out) for n in match.groups() if n is not None)
    return Saturation(
        (requests - errors) / wall_s, percentiles[50], percentiles[99], requests, min(errors, requests), "wrk"
    )
