"""Ingest throughput on a loopback S3-protocol server: rayline vs naive Ray Data vs a raw client.

(a) rayline's ingest workload (list + concurrent fetch in Ray tasks + Parquet shards),
(b) ``ray.data.read_images`` over the same prefix (one GET after another per read task),
(c) a plain boto3 client doing 32 concurrent GETs, no Ray, no output.

Needs nothing started by hand: it starts its own S3 server and Ray. Prints
images/s and ratios, then one line of JSON. Targets: a/c >= 0.8, a/b >= 5.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.s3_server import S3_ENV, create_bucket, process_cpu_seconds, s3_server  # noqa: E402

BUCKET = "rayline-bench"
REPEATS = 3


SERVER_PID: list[int] = []


def _best_rate(name: str, count: int, run: object, repeats: int = REPEATS) -> float:
    """Best of ``repeats`` runs, in images/s; also prints how busy the S3 server was."""
    best = float("inf")
    for _ in range(repeats):
        cpu_before = process_cpu_seconds(SERVER_PID[0])
        started = time.perf_counter()
        run()  # type: ignore[operator]
        elapsed = time.perf_counter() - started
        server_busy = (process_cpu_seconds(SERVER_PID[0]) - cpu_before) / elapsed
        print(f"  {name}: {elapsed:.2f}s, S3 server process busy {server_busy:.0%} of one core")
        best = min(best, elapsed)
    return count / best


def main() -> None:
    os.environ.update(S3_ENV)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with s3_server(SERVER_PID) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        import boto3
        import ray

        from ray_workloads import ingest
        from rayline import ray_cluster, storage
        from rayline.seed import seed

        create_bucket(endpoint, BUCKET)
        raw = f"s3://{BUCKET}/raw"
        count = seed(raw).total
        ray_cluster.connect()
        ray.data.DataContext.get_current().enable_progress_bars = False

        client = boto3.client("s3", endpoint_url=endpoint)

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

        rayline_ingest()  # warm-up: Ray workers and imports
        raw_rate = _best_rate("raw", count, raw_client)
        ingest_rate = _best_rate("rayline", count, rayline_ingest)
        naive_rate = _best_rate("naive", count, naive_read_images, repeats=1)
        ray_cluster.disconnect()

    figures = {
        "ingest_img_s": round(ingest_rate, 1),
        "naive_img_s": round(naive_rate, 1),
        "raw_img_s": round(raw_rate, 1),
        "ratio_vs_raw": round(ingest_rate / raw_rate, 3),
        "ratio_vs_naive": round(ingest_rate / naive_rate, 3),
    }
    print(f"objects: {count} digits PNGs on a loopback S3-protocol server (moto)")
    print(f"(a) rayline ingest      {ingest_rate:8.1f} images/s")
    print(f"(b) ray.data.read_images {naive_rate:7.1f} images/s")
    print(f"(c) raw 32 concurrent GETs {raw_rate:5.1f} images/s")
    print(f"a/c = {figures['ratio_vs_raw']:.2f} (target >= 0.8)   a/b = {figures['ratio_vs_naive']:.2f} (target >= 5)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
