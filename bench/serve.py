"""Online serving latency on loopback: through the router vs the model deployment called directly.

Setup (needs nothing started by hand): an embedded Ray cluster with a temporary
``RAYLINE_STORAGE``, an untrained digits-sized SmallCNN (``ModelSpec(num_classes=10)``,
default width; latency does not depend on the weights) registered and served with the
default ``ServeConfig`` (only the name and a free loopback port differ) at 100% traffic.
Requests are the real scikit-learn digits as 32 px PNGs (``rayline.seed.digit_objects``),
sent as the raw body of a POST over a kept-alive ``http.client`` connection per client.

The two paths, both over HTTP from the same client, through the same Serve HTTP proxy:

* **router**: ``POST /predict`` → proxy → ``Router`` replica (body read, routing table,
  weighted choice, sample recording, JSON answer) → ``DeploymentHandle`` call → the
  version's ``ModelServer`` replica (decode, ``@serve.batch``, forward pass, top-k).
* **direct**: ``POST /direct`` → proxy → a ``ModelServer`` replica of the same version,
  deployed a second time as its own application with an HTTP route. The deployment is
  the one ``serving.model_server.model_app`` builds (same options: replicas, CPUs, batching,
  ``max_ongoing_requests``, access log); only its class is a subclass whose ``__call__``
  reads the body and answers ``predict`` as JSON. So the difference between the paths is
  the router replica and the extra handle hop: what the router adds.

Latency is per request on the client: send → whole answer read. Figures:

* closed loop: at each ``--concurrency`` level, that many clients each send their next
  request when the previous one is answered; ``--requests`` requests per path and level,
  split into rounds that alternate the order of the paths (so a change in background load
  hits both alike), after a warm-up. p50, p99, requests/s (answered / wall time) and
  errors (any answer but 200, or a failed connection) per path.
* ``router_overhead`` = router p50 / direct p50 - 1 at the first concurrency level
  (target <= 0.15).
* open loop: requests through the router sent at fixed times, 20 per second for 15 s
  whatever the answers do; latency from the scheduled send time (so a stall counts for
  every request queued behind it). ``p99_ms_at_20rps`` (target <= 50 ms).
* ``errors``: all failed requests of every run above.

Serve's logs (access log included: the default ``ServeConfig`` keeps it on) go to the
replicas' log files only (``RAY_SERVE_LOG_TO_STDERR=0``), not echoed into the client's process.

``--quick`` is a smoke test (few requests, one level, 5 s paced run), not the figures.
The embedded cluster shares the machine with the client: run it on a quiet machine (the
load average is printed before and after). Last line: one line of JSON.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ray_workloads.serving.model_server import ModelServer  # noqa: E402

HOST = "127.0.0.1"
ROUTER_PATH = "/predict"
DIRECT_PREFIX = "/direct"
ROUNDS = 3
WARMUP_REQUESTS = 100
PACED_RATE = 20.0
PACED_S = 15.0
PACED_CLIENTS = 16  # connections of the open-loop run: enough that a slow answer never delays a send
TARGET_OVERHEAD = 0.15
TARGET_P99_MS = 50.0


class DirectModelServer(ModelServer):
    """The model deployment answering HTTP itself (the bench's direct path; no router)."""

    async def __call__(self, request: Request) -> JSONResponse:
        result = await self.predict(await request.body())
        if not result.pop("ok"):
            return JSONResponse({"error": result["error"], "detail": result["detail"]}, status_code=result["status"])
        return JSONResponse(result)


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


def closed_loop(port: int, path: str, bodies: Sequence[bytes], concurrency: int, requests: int) -> Run:
    """``concurrency`` clients, each sending its next request once the last is answered."""
    run = Run()
    lock = threading.Lock()
    counter = itertools.count()
    start = threading.Barrier(concurrency + 1)

    def client_loop() -> None:
        client = Client(port)
        client.post(path, bodies[0])  # connect before the clock starts
        start.wait()
        latencies: list[float] = []
        errors = 0
        while (i := next(counter)) < requests:
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

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    run.wall_s = time.perf_counter() - began
    return run


def open_loop(port: int, path: str, bodies: Sequence[bytes], rate: float, duration_s: float) -> Run:
    """Requests sent at fixed times (``rate`` per second); latency counted from the scheduled time."""
    count = int(rate * duration_s)
    jobs: queue.Queue[int] = queue.Queue()
    for i in range(count):
        jobs.put(i)
    run = Run()
    lock = threading.Lock()
    clients = [Client(port) for _ in range(PACED_CLIENTS)]
    for client in clients:
        client.post(path, bodies[0])  # connect before the clock starts
    t0 = time.perf_counter() + 0.1

    def worker(client: Client) -> None:
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                break
            scheduled = t0 + i / rate
            time.sleep(max(0.0, scheduled - time.perf_counter()))
            ok = client.post(path, bodies[i % len(bodies)])
            with lock:
                if ok:
                    run.latencies_ms.append((time.perf_counter() - scheduled) * 1000)
                else:
                    run.errors += 1
        client.close()

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.wall_s = time.perf_counter() - t0
    return run


def compare(port: int, bodies: Sequence[bytes], concurrency: int, requests: int) -> dict[str, Run]:
    """Both paths at one concurrency level, in rounds of alternating order."""
    runs = {"router": Run(), "direct": Run()}
    paths = {"router": ROUTER_PATH, "direct": DIRECT_PREFIX}
    per_round = max(concurrency, requests // ROUNDS)
    for round_ in range(ROUNDS):
        order = ("router", "direct") if round_ % 2 == 0 else ("direct", "router")
        for name in order:
            runs[name].extend(closed_loop(port, paths[name], bodies, concurrency, per_round))
    return runs


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1500, help="Requests per path and concurrency level.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8], help="Closed-loop clients.")
    parser.add_argument("--quick", action="store_true", help="A smoke test: few requests, one level, 5 s paced.")
    args = parser.parse_args()
    requests, levels, paced_s, warmup = args.requests, args.concurrency, PACED_S, WARMUP_REQUESTS
    if args.quick:
        requests, levels, paced_s, warmup = min(requests, 150), levels[:1], 5.0, 20

    storage_dir = tempfile.TemporaryDirectory(prefix="rayline-bench-serve-")
    os.environ["RAYLINE_STORAGE"] = storage_dir.name
    os.environ.pop("RAY_ADDRESS", None)  # always an embedded cluster of our own
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # replicas log to their files only: echoed through Ray into this process, every access-log
    # line would cost the client CPU (two lines per request on the router path, one direct)
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")

    from ray import serve

    from bench.support.inference_night import register_untrained
    from ray_workloads.models import ModelSpec
    from ray_workloads.serving import control as serve_control
    from ray_workloads.serving.config import ServeConfig
    from ray_workloads.serving.model_server import model_app
    from rayline import ray_cluster
    from rayline.seed import digit_objects
    from rayline.testing.s3_server import free_port

    bodies = [data for _, data in itertools.islice(digit_objects(32), 500)]
    spec = ModelSpec(num_classes=10)  # what register_untrained registers
    print(f"load average before: {load_average()}")
    started = time.perf_counter()
    connection = ray_cluster.connect()
    cfg = ServeConfig(name="rayline-bench", port=free_port())
    direct_app = f"{cfg.name}-direct"
    try:
        model = register_untrained("digits-bench", champion=False)
        serve_control.start(cfg)
        serve_control.deploy_version(model, cfg)
        serve_control.set_weights({model.version: 100.0}, cfg)
        # the deployment model_app builds (same options), with a class that also answers HTTP;
        # Application._bound_deployment is Ray's private API: this fails loudly if it goes away
        deployment: Any = model_app(model, cfg)._bound_deployment
        direct = deployment.options(func_or_class=DirectModelServer).bind(model, cfg.top_k, cfg.max_pixels)
        serve.run(direct, name=direct_app, route_prefix=DIRECT_PREFIX)
        print(
            f"Ray ({connection.num_cpus:.0f} logical CPUs), Serve, router and model up in "
            f"{time.perf_counter() - started:.1f} s; model {model.name} v{model.version} "
            f"({spec.arch}, width {spec.width}), {len(bodies)} digit PNGs of ~{np.mean([len(b) for b in bodies]):.0f} B"
        )
        print(
            f"config: router replicas {cfg.router_replicas}, model replicas {cfg.replicas}, "
            f"max_batch_size {cfg.max_batch_size}, batch_wait_timeout_s {cfg.batch_wait_timeout_s}, "
            f"access_log {cfg.access_log}"
        )
        total_errors = 0
        for path in (ROUTER_PATH, DIRECT_PREFIX):
            total_errors += closed_loop(cfg.port, path, bodies, max(levels), warmup).errors

        results: dict[int, dict[str, Run]] = {}
        for level in levels:
            results[level] = compare(cfg.port, bodies, level, requests)
            router, direct_run = results[level]["router"], results[level]["direct"]
            overhead = router.percentile(50) / direct_run.percentile(50) - 1
            print(f"closed loop, {level} clients, {ROUNDS} alternating rounds:")
            print(router.line("router"))
            print(direct_run.line("direct"))
            print(f"  router adds {overhead:+.1%} to p50 ({router.percentile(50) - direct_run.percentile(50):+.2f} ms)")
            total_errors += router.errors + direct_run.errors

        paced = open_loop(cfg.port, ROUTER_PATH, bodies, PACED_RATE, paced_s)
        total_errors += paced.errors
        print(f"open loop through the router, {PACED_RATE:.0f} req/s for {paced_s:.0f} s:")
        print(paced.line("router"))
    finally:
        try:
            if direct_app in serve.status().applications:
                serve.delete(direct_app)
        finally:
            serve_control.shutdown(cfg)
            ray_cluster.disconnect()
            storage_dir.cleanup()
    print(f"load average after: {load_average()}")

    first = results[levels[0]]
    figures = {
        "router_p50_ms": round(first["router"].percentile(50), 3),
        "direct_p50_ms": round(first["direct"].percentile(50), 3),
        "router_overhead": round(first["router"].percentile(50) / first["direct"].percentile(50) - 1, 4),
        "p99_ms_at_20rps": round(paced.percentile(99), 3),
        "errors": total_errors,
    }
    print(
        f"targets: router overhead {figures['router_overhead']:+.1%} at {levels[0]} clients "
        f"(<= +{TARGET_OVERHEAD:.0%}); p99 at {PACED_RATE:.0f} req/s {figures['p99_ms_at_20rps']:.1f} ms "
        f"(<= {TARGET_P99_MS:.0f} ms); errors {total_errors}"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
