"""Ingest throughput on a loopback S3-protocol server: rayline vs naive Ray Data vs a raw client.

(a) rayline's ingest workload, (b) ``ray.data.read_images`` over the same prefix, (c) a plain boto3 client
doing 32 concurrent GETs; each against the bare server and through the fault proxy adding ``--latency-ms``
to every request, where latency, not the server's CPU, bounds throughput. Starts its own S3 server, proxy
and Ray. Targets and JSON keys: bench/README.md. Prints images/s and ratios, then one line of JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rayline.testing.fault_proxy_control import fault_proxy
from rayline.testing.s3_server import S3_ENV, create_bucket, process_cpu_seconds, s3_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.support, run as a script

from bench.support.results import emit  # noqa: E402

BUCKET = "rayline-bench"
REPEATS = 3


def _best_rate(name: str, count: int, run: Callable[[], None], pids: dict[str, int], repeats: int = REPEATS) -> float:
    """Best of ``repeats`` runs, in images/s; also prints how busy the S3 server (and the proxy) were."""
    best = float("inf")
    for _ in range(repeats):
        cpu_before = {who: process_cpu_seconds(pid) for who, pid in pids.items()}
        started = time.perf_counter()
        run()
        elapsed = time.perf_counter() - started
        busy = ", ".join(
            f"{who} busy {(process_cpu_seconds(pid) - cpu_before[who]) / elapsed:.0%}" for who, pid in pids.items()
        )
        print(f"  {name}: {elapsed:.2f}s ({busy} of one core)")
        best = min(best, elapsed)
    return count / best


def _measure(endpoint: str, count: int, pids: dict[str, int]) -> dict[str, float]:
    """images/s of (a), (b), (c) with every S3 client, Ray's workers included, talking to ``endpoint``."""
    import boto3
    import ray
    from botocore.config import Config

    from rayline import ray_cluster, storage
    from rayline.ray_workloads.data import ingest

    os.environ["AWS_ENDPOINT_URL"] = endpoint  # before Ray starts: its workers inherit it
    raw = f"s3://{BUCKET}/raw"
    ray_cluster.connect()
    ray.data.DataContext.get_current().enable_progress_bars = False
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=32))

    def raw_client() -> None:
        keys = [
            o["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="raw/")
            for o in page.get("Contents", [])
        ]
        with ThreadPoolExecutor(32) as pool:
            sizes = list(pool.map(lambda k: len(client.get_object(Bucket=BUCKET, Key=k)["Body"].read()), keys))
        assert len(sizes) == count

    def rayline_ingest() -> None:
        result = ingest.run(ingest.IngestConfig(source_uri=raw, output_root=f"s3://{BUCKET}/ingested", force=True))
        assert result.object_count == count and result.fetch_errors == 0

    def naive_read_images() -> None:
        fs, path = storage.arrow_filesystem(raw)
        rows = ray.data.read_images(path, filesystem=fs, mode="RGB").materialize().count()
        assert rows == count

    try:
        rayline_ingest()  # warm-up: Ray workers and imports
        return {
            "raw": _best_rate("raw", count, raw_client, pids),
            "ingest": _best_rate("rayline", count, rayline_ingest, pids),
            "naive": _best_rate("naive", count, naive_read_images, pids, repeats=1),
        }
    finally:
        ray_cluster.disconnect()


def _print(title: str, rates: dict[str, float]) -> None:
    print(title)
    print(f"(a) rayline ingest      {rates['ingest']:8.1f} images/s")
    print(f"(b) ray.data.read_images {rates['naive']:7.1f} images/s")
    print(f"(c) raw 32 concurrent GETs {rates['raw']:5.1f} images/s")
    print(
        f"a/c = {rates['ingest'] / rates['raw']:.2f} (target >= 0.8)   "
        f"a/b = {rates['ingest'] / rates['naive']:.2f} (target >= 5)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to each request by the proxy")
    args = parser.parse_args()
    os.environ.update(S3_ENV)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    server_pid: list[int] = []
    with s3_server(server_pid) as endpoint, fault_proxy(endpoint, latency_ms=args.latency_ms) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        from rayline.seed import seed

        create_bucket(endpoint, BUCKET)
        count = seed(f"s3://{BUCKET}/raw").total
        print(f"bare server ({endpoint})")
        bare = _measure(endpoint, count, {"S3 server": server_pid[0]})
        print(f"through the proxy, {args.latency_ms:g} ms added per request ({proxy.endpoint})")
        slow = _measure(proxy.endpoint, count, {"S3 server": server_pid[0], "proxy": proxy.pid})
        assert proxy.stats().get("faults", 0) == 0

    figures: dict[str, float] = {}
    for suffix, rates in (("", bare), ("_latency", slow)):
        figures |= {f"{reader}_img_s{suffix}": round(rates[reader], 1) for reader in ("ingest", "naive", "raw")}
        figures |= {f"ratio_vs_{b}{suffix}": round(rates["ingest"] / rates[b], 3) for b in ("raw", "naive")}
    figures["latency_ms"] = args.latency_ms
    print(f"objects: {count} digits PNGs on a loopback S3-protocol server (moto)")
    _print("bare server:", bare)
    _print(f"through the proxy, +{args.latency_ms:g} ms per request:", slow)
    emit("ingest", figures)


if __name__ == "__main__":
    main()
