"""Online serving latency on loopback: through the router vs the model deployment called directly.

An embedded Ray cluster with a temporary ``RAYLINE_STORAGE``; an untrained digits-sized SmallCNN served
with the default ``ServeConfig`` (only the name and a free port differ) at 100% traffic; requests are the
real scikit-learn digits as 32 px PNGs, POSTed as the raw body over a kept-alive connection per client.

* **router**: ``POST /predict`` → Serve's proxy → ``Router`` replica → ``DeploymentHandle`` call → the
  version's ``ModelServer`` replica.
* **direct**: ``POST /direct`` → the proxy → a ``ModelServer`` replica of the same version, deployed again
  as its own application by ``model_app``'s deployment (same options), with a subclass that answers HTTP.
  The difference between the paths is the router replica and the extra handle hop.

The closed loop, the open loop and saturation (by ``wrk`` when installed, else Python threads:
bench/support/http_load.py), what each figure includes and the targets: bench/README.md. Serve's logs go
to the replicas' files only (``RAY_SERVE_LOG_TO_STDERR=0``). The cluster shares the machine with the
client, so the load average is printed before and after. ``--quick``: a smoke test, not the figures.
Last line: one line of JSON.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.http_load import Run, Saturation, closed_loop, open_loop, saturate  # noqa: E402
from bench.support.results import emit  # noqa: E402
from rayline.ray_workloads.serving.model_server import ModelServer  # noqa: E402

ROUTER_PATH = "/predict"
DIRECT_PREFIX = "/direct"
PATHS = {"router": ROUTER_PATH, "direct": DIRECT_PREFIX}
ROUNDS = 3
WARMUP_REQUESTS = 100
PACED_RATE = 20.0
PACED_S = 15.0
SATURATION_CONNECTIONS = 8
SATURATION_S = 20.0
SATURATION_ROUNDS = 2
TARGET_OVERHEAD = 0.15
TARGET_P99_MS = 50.0
TARGET_SATURATION_RPS = 138.0  # what the router answered at saturation on 2026-11-30
TARGET_SATURATION_P99_MS = 100.0


class DirectModelServer(ModelServer):
    """The model deployment answering HTTP itself (the bench's direct path; no router)."""

    async def __call__(self, request: Request) -> JSONResponse:
        result = await self.predict(await request.body())
        if not result.pop("ok"):
            return JSONResponse({"error": result["error"], "detail": result["detail"]}, status_code=result["status"])
        return JSONResponse(result)


def compare(port: int, bodies: Sequence[bytes], concurrency: int, requests: int) -> dict[str, Run]:
    """Both paths at one concurrency level, in rounds of alternating order."""
    runs = {"router": Run(), "direct": Run()}
    per_round = max(concurrency, requests // ROUNDS)
    for round_ in range(ROUNDS):
        order = ("router", "direct") if round_ % 2 == 0 else ("direct", "router")
        for name in order:
            runs[name].extend(closed_loop(port, PATHS[name], bodies, concurrency, per_round))
    return runs


def load_average() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def saturation(port: int, body: bytes, connections: int, seconds: float, rounds: int) -> dict[str, Saturation]:
    """Both paths saturated, in rounds of alternating order; each path's figures are its rounds' means."""
    runs: dict[str, list[Saturation]] = {"router": [], "direct": []}
    for round_ in range(rounds):
        for name in ("router", "direct") if round_ % 2 == 0 else ("direct", "router"):
            runs[name].append(saturate(port, PATHS[name], body, connections, seconds))
            print(runs[name][-1].line(name))
    return {
        name: Saturation(
            statistics.mean(r.rps for r in done),
            statistics.mean(r.p50_ms for r in done),
            statistics.mean(r.p99_ms for r in done),
            sum(r.requests for r in done),
            sum(r.errors for r in done),
            done[0].client,
        )
        for name, done in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1500, help="Requests per path and concurrency level.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8], help="Closed-loop clients.")
    parser.add_argument("--saturation-s", type=float, default=SATURATION_S, help="Seconds of each saturation run.")
    parser.add_argument("--saturation-rounds", type=int, default=SATURATION_ROUNDS)
    parser.add_argument("--saturation-only", action="store_true", help="Only the saturation case.")
    parser.add_argument("--quick", action="store_true", help="A smoke test: few requests, one level, 5 s paced.")
    args = parser.parse_args()
    requests, levels, paced_s, warmup = args.requests, args.concurrency, PACED_S, WARMUP_REQUESTS
    saturation_s, saturation_rounds = args.saturation_s, args.saturation_rounds
    if args.quick:
        requests, levels, paced_s, warmup = min(requests, 150), levels[:1], 5.0, 20
        saturation_s, saturation_rounds = 5.0, 1

    storage_dir = tempfile.TemporaryDirectory(prefix="rayline-bench-serve-")
    os.environ["RAYLINE_STORAGE"] = storage_dir.name
    os.environ.pop("RAY_ADDRESS", None)  # always an embedded cluster of our own
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    from ray import serve

    from bench.support.inference_night import register_untrained
    from rayline import ray_cluster
    from rayline.ray_workloads.architectures.build import ModelSpec
    from rayline.ray_workloads.serving import control as serve_control
    from rayline.ray_workloads.serving.config import ServeConfig
    from rayline.ray_workloads.serving.model_server import model_app
    from rayline.seed import digit_objects
    from rayline.testing.s3_server import free_port

    bodies = [data for _, data in itertools.islice(digit_objects(32), 500)]
    spec = ModelSpec(num_classes=10)  # what register_untrained registers
    print(f"load average before: {load_average()}")
    started = time.perf_counter()
    connection = ray_cluster.connect()
    cfg = ServeConfig(name="rayline-bench", port=free_port())
    direct_app = f"{cfg.name}-direct"
    results: dict[int, dict[str, Run]] = {}
    paced: Run | None = None
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
            f"access_log {cfg.access_log}; RAY_SERVE_LOG_TO_STDERR={os.environ.get('RAY_SERVE_LOG_TO_STDERR')}"
        )
        total_errors = 0
        for path in (ROUTER_PATH, DIRECT_PREFIX):
            total_errors += closed_loop(cfg.port, path, bodies, max(levels), warmup).errors

        if not args.saturation_only:
            for level in levels:
                results[level] = compare(cfg.port, bodies, level, requests)
                router, direct_run = results[level]["router"], results[level]["direct"]
                overhead = router.percentile(50) / direct_run.percentile(50) - 1
                print(f"closed loop, {level} clients, {ROUNDS} alternating rounds:")
                print(router.line("router"))
                print(direct_run.line("direct"))
                added_ms = router.percentile(50) - direct_run.percentile(50)
                print(f"  router adds {overhead:+.1%} to p50 ({added_ms:+.2f} ms)")
                total_errors += router.errors + direct_run.errors

            paced = open_loop(cfg.port, ROUTER_PATH, bodies, PACED_RATE, paced_s)
            total_errors += paced.errors
            print(f"open loop through the router, {PACED_RATE:.0f} req/s for {paced_s:.0f} s:")
            print(paced.line("router"))

        print(
            f"saturation: {SATURATION_CONNECTIONS} connections posting one digit PNG for {saturation_s:g} s, "
            f"{saturation_rounds} alternating round(s):"
        )
        saturated = saturation(cfg.port, bodies[3], SATURATION_CONNECTIONS, saturation_s, saturation_rounds)
        total_errors += sum(s.errors for s in saturated.values())
    finally:
        try:
            if direct_app in serve.status().applications:
                serve.delete(direct_app)
        finally:
            serve_control.shutdown(cfg)
            ray_cluster.disconnect()
            storage_dir.cleanup()
    print(f"load average after: {load_average()}")
    emit("serve", figures(results, levels, paced, saturated, total_errors))


def figures(
    results: dict[int, dict[str, Run]],
    levels: Sequence[int],
    paced: Run | None,
    saturated: dict[str, Saturation],
    total_errors: int,
) -> dict[str, Any]:
    """The JSON line's figures (closed and open loop ones only when they ran), with the targets printed."""
    router, direct = saturated["router"], saturated["direct"]
    out: dict[str, Any] = {}
    if results and paced is not None:
        first = results[levels[0]]
        overhead = first["router"].percentile(50) / first["direct"].percentile(50) - 1
        out = {
            "router_p50_ms": round(first["router"].percentile(50), 3),
            "direct_p50_ms": round(first["direct"].percentile(50), 3),
            "router_overhead": round(overhead, 4),
            "p99_ms_at_20rps": round(paced.percentile(99), 3),
        }
        print(
            f"targets: router overhead {overhead:+.1%} at {levels[0]} clients (<= +{TARGET_OVERHEAD:.0%}); "
            f"p99 at {PACED_RATE:.0f} req/s {paced.percentile(99):.1f} ms (<= {TARGET_P99_MS:.0f} ms)"
        )
    print(
        f"saturation targets: router {router.rps:.1f} req/s (>= {TARGET_SATURATION_RPS:.0f}), "
        f"p99 {router.p99_ms:.1f} ms (< {TARGET_SATURATION_P99_MS:.0f} ms); direct {direct.rps:.1f} req/s, "
        f"p99 {direct.p99_ms:.1f} ms; errors {total_errors}"
    )
    for name, run in saturated.items():
        out |= {
            f"saturation_{name}_rps": round(run.rps, 1),
            f"saturation_{name}_p50_ms": round(run.p50_ms, 2),
            f"saturation_{name}_p99_ms": round(run.p99_ms, 2),
        }
    out |= {"saturation_client": router.client, "errors": total_errors}
    return out


if __name__ == "__main__":
    main()
