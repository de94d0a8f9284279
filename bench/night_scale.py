"""Nights at scale: what grows with the number of images, measured as ratios between sizes of one run.

``batch_inference.run`` on nights of tiny objects, so that orchestration, not the model, dominates: the
digits CNN (untrained ``small_cnn``, 32 px) on ``--sizes`` objects on local disk in 256 hashed
sub-prefixes, as buckets of photos are laid out, and ``--s3-size`` objects on moto through the fault
proxy with ``--latency-ms`` a request. Then ``prepare-data``'s ingest over the same local objects
(``--no-ingest`` skips it). What is printed, the targets and the JSON keys: bench/README.md.

Each night runs in a fresh driver process on its own embedded Ray cluster, after its local objects were
read once: the figures are rayline's work, not the disk's cold reads of a million small files. The
objects are generated once under ``$RAYLINE_BENCH_CACHE`` (default /tmp/rayline-bench-night-scale).
``--quick``: 2,000 and 20,000 objects (a smoke test, not the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.support.children import child_env, parse_result, print_result, work_dir  # noqa: E402
from bench.support.inference_images import warm_page_cache  # noqa: E402
from bench.support.inference_night import register_untrained, resolve_champion  # noqa: E402
from bench.support.inference_s3 import loopback_s3  # noqa: E402
from bench.support.process_tree import _rss_bytes, proc_figure, watch_tree  # noqa: E402
from bench.support.results import emit  # noqa: E402

CACHE = Path(os.environ.get("RAYLINE_BENCH_CACHE", "/tmp/rayline-bench-night-scale"))
DAY = "2026-11-28"
PREFIXES = 256
BUCKET = "night-scale"


def local_night(count: int) -> Path:
    """``count`` tiny digit PNGs under ``<hh>/<i>.png`` (256 hashed prefixes); made once, then reused."""
    folder = CACHE / f"local-{count}"
    done = folder / "_COMPLETE"  # an underscore name: no input, skipped by the listing
    if done.exists():
        return folder
    from rayline.seed import digit_objects

    images = [data for _, data in digit_objects(32)]
    shutil.rmtree(folder, ignore_errors=True)
    for prefix in range(PREFIXES):
        (folder / f"{prefix:02x}").mkdir(parents=True)
    for i in range(count):
        (folder / f"{i % PREFIXES:02x}" / f"{i:08d}.png").write_bytes(images[i % len(images)])
    done.write_text(str(count))
    return folder


def s3_night(endpoint: str, count: int) -> str:
    """``count`` tiny PNGs in a bucket of the S3-protocol server, in 256 hashed prefixes; their prefix."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    from rayline.seed import digit_objects

    images = [data for _, data in digit_objects(32)]
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(max_pool_connections=32))

    def put(i: int) -> None:
        client.put_object(Bucket=BUCKET, Key=f"in/{i % PREFIXES:02x}/{i:08d}.png", Body=images[i % len(images)])

    with ThreadPoolExecutor(32) as pool:
        for _ in pool.map(put, range(count), chunksize=256):
            pass
    return f"s3://{BUCKET}/in"


def child_main(spec: dict[str, Any]) -> None:
    if spec.get("kind") == "ingest":
        child_ingest(spec)
        return
    from deltalake import DeltaTable

    from rayline import ray_cluster
    from rayline.ray_workloads.nightly import batch_inference
    from rayline.tables.delta_tables import Night, storage_options

    version = resolve_champion(spec["model_root"], "digits")
    ray_cluster.connect(preload=batch_inference.WORKER_PRELOAD)
    cfg = batch_inference.InferenceConfig(
        input_uri=spec["input"], tables_root=spec["tables"], dt=DAY, model=version, code_version="bench", actors=2
    )
    result = batch_inference.run(cfg)
    # the night's own peak, before the bench reads the whole night back into this process (that read holds
    # every row: ~280 MB at 1 M, which is the bench's, not the driver's)
    night_peak_mb = proc_figure("VmHWM") / 1024
    began = time.perf_counter()
    table = DeltaTable(result.predictions_table, storage_options=storage_options(result.predictions_table))
    rows = table.to_pyarrow_table(partitions=[(k, "=", v) for k, _, v in Night("digits", DAY).filters]).num_rows
    read_s = time.perf_counter() - began
    kept = {"inputs", "elapsed_s", "phase_s", "data_files", "delta_log_bytes", "listing_parts", "blocks"}
    summary = result.model_dump(mode="json", include=kept) | {"rows": rows, "read_s": read_s}
    summary |= {"night_peak_mb": night_peak_mb, "result_bytes": len(result.model_dump_json())}
    # the driver's own CPU (all its threads, Ray Data's executor included): its cost per block
    print_result(summary | {"driver_cpu_s": time.process_time()})


def child_ingest(spec: dict[str, Any]) -> None:
    """``prepare-data``'s workload over the same objects: listing parts, shards packed from them, the manifest."""
    from rayline import ray_cluster
    from rayline.ray_workloads.data import ingest

    os.environ["RAYLINE_STORAGE"] = spec["model_root"]
    ray_cluster.connect()
    began = time.perf_counter()
    result = ingest.run(ingest.IngestConfig(source_uri=spec["input"], output_root=spec["tables"], force=True))
    summary = {
        "inputs": result.object_count,
        "elapsed_s": time.perf_counter() - began,
        "shards": result.shard_count,
        "fetch_errors": result.fetch_errors,
        "result_bytes": len(result.model_dump_json()),
    }
    print_result(summary)


def _first_block_s(tables: str, began: float, stop: threading.Event, out: dict[str, float]) -> None:
    """Seconds from the driver's start until the first block file of the night exists (local tables only)."""
    night = Path(tables, "predictions", "model_name=digits", f"dt={DAY}")
    while not stop.is_set():
        for blocks in night.glob("blocks-*") if night.exists() else []:
            if any(next(os.scandir(part), None) for part in os.scandir(blocks) if part.is_dir()):
                out["first_block_s"] = time.perf_counter() - began
                return
        stop.wait(0.05)


def measure(name: str, input_uri: str, work: str, env: dict[str, str], kind: str = "night") -> dict[str, Any]:
    """One night (or one ingest) in a fresh driver process: its figures, and the driver's and the tree's peak RSS."""
    tables = str(Path(work, "tables", name))
    spec = {"input": input_uri, "tables": tables, "model_root": work, "kind": kind}
    stop, first = threading.Event(), {"first_block_s": float("nan")}
    peak = {"driver_mb": 0.0}
    with watch_tree(interval_s=2.0) as tree:  # its /proc walk is the bench's own CPU: not every 0.5 s
        began = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if kind == "night":
            watcher = threading.Thread(target=_first_block_s, args=(tables, began, stop, first), daemon=True)
            watcher.start()

        def sample_driver() -> None:
            while proc.poll() is None:
                peak["driver_mb"] = max(peak["driver_mb"], _rss_bytes(proc.pid) / 2**20)
                time.sleep(0.2)

        sampler = threading.Thread(target=sample_driver, daemon=True)
        sampler.start()
        stdout, stderr = proc.communicate()
        stop.set()
        sampler.join()
    figures = parse_result(f"night {name}", proc.returncode, stdout, stderr)
    # a night's driver reports its own peak before the read-back (night_peak_mb); the sampled one includes it
    driver_mb = figures.get("night_peak_mb", peak["driver_mb"])
    figures.update(first, driver_rss_mb=driver_mb, process_peak_mb=peak["driver_mb"], tree_rss_mb=tree["rss_mb"])
    return figures


def report(name: str, f: dict[str, Any]) -> None:
    phases = f["phase_s"]
    print(
        f"{name}: {f['inputs']:,} images in {f['elapsed_s']:.1f} s = {f['inputs'] / f['elapsed_s']:,.0f} img/s; "
        f"driver peak RSS {f['driver_rss_mb']:.0f} MB (with the read-back {f['process_peak_mb']:.0f} MB, "
        f"tree {f['tree_rss_mb']:.0f} MB); listing {phases.get('list', 0):.1f} s in the driver, "
        f"{f['listing_parts']} parts in all; first block {f['first_block_s']:.1f} s; "
        f"files {f['data_files']}; commit {phases.get('commit', 0):.2f} s, _delta_log +{f['delta_log_bytes']} B; "
        f"compaction {phases.get('compact', 0):.1f} s; read back {f['read_s']:.2f} s; result {f['result_bytes']} B; "
        f"driver CPU {f['driver_cpu_s']:.0f} s for {f['blocks']:,} blocks"
    )


def report_ingest(name: str, f: dict[str, Any]) -> None:
    print(
        f"{name}: {f['inputs']:,} objects in {f['elapsed_s']:.1f} s = {f['inputs'] / f['elapsed_s']:,.0f} obj/s; "
        f"driver peak RSS {f['driver_rss_mb']:.0f} MB (tree {f['tree_rss_mb']:.0f} MB); {f['shards']} shards; "
        f"result {f['result_bytes']} B"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs=2, default=[100_000, 1_000_000])
    parser.add_argument("--s3-size", type=int, default=100_000, help="0: no S3 night")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-ingest", action="store_true", help="skip prepare-data's ingest at both sizes")
    args = parser.parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return
    if args.quick:
        args.sizes, args.s3_size = [2_000, 20_000], 2_000
    small, large = args.sizes
    work = work_dir("rlns-")
    env = child_env(work)
    nights: dict[str, dict[str, Any]] = {}
    ingests: dict[str, dict[str, Any]] = {}
    try:
        register_untrained("digits", root=work)
        for size in (small, large):
            warm_page_cache(local_night(size))
            nights[f"local {size:,}"] = measure(f"local-{size}", str(local_night(size)), work, env)
            report(f"local {size:,}", nights[f"local {size:,}"])
        for size in () if args.no_ingest else (small, large):
            warm_page_cache(local_night(size))
            ingests[f"ingest {size:,}"] = measure(f"ingest-{size}", str(local_night(size)), work, env, kind="ingest")
            report_ingest(f"ingest {size:,}", ingests[f"ingest {size:,}"])
        if args.s3_size:
            nights["s3"] = s3_measure(args.s3_size, args.latency_ms, work, env)
            report(f"S3 {args.s3_size:,} at {args.latency_ms:.0f} ms", nights["s3"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a, b = nights[f"local {small:,}"], nights[f"local {large:,}"]
    rate = {k: f["inputs"] / f["elapsed_s"] for k, f in nights.items()}
    summary = {
        "driver_rss_ratio": round(b["driver_rss_mb"] / a["driver_rss_mb"], 3),
        "first_block_s_1m": round(b["first_block_s"], 2),
        "files_per_night_1m": max(b["data_files"].values()),
        "img_s_ratio_1m_100k": round(rate[f"local {large:,}"] / rate[f"local {small:,}"], 3),
        "commit_share_1m": round(b["phase_s"].get("commit", 0.0) / b["elapsed_s"], 4),
        "ingest_rss_ratio": (
            round(ingests[f"ingest {large:,}"]["driver_rss_mb"] / ingests[f"ingest {small:,}"]["driver_rss_mb"], 3)
            if ingests
            else None
        ),
        "sizes": [small, large],
        "nights": nights,
        "ingests": ingests,
    }
    print(
        f"targets: driver RSS ratio {summary['driver_rss_ratio']} (<= 1.25), first block "
        f"{summary['first_block_s_1m']} s (<= 30), files {summary['files_per_night_1m']} (<= 20), "
        f"img/s ratio {summary['img_s_ratio_1m_100k']} (>= 0.95), commit share {summary['commit_share_1m']} (<= 0.02), "
        f"ingest driver RSS ratio {summary['ingest_rss_ratio']} (<= 1.25)"
    )
    emit("night_scale", summary)


def s3_measure(count: int, latency_ms: float, work: str, env: dict[str, str]) -> dict[str, Any]:
    from rayline.testing.fault_proxy_control import fault_proxy

    s3_env = dict(env)
    with loopback_s3(s3_env, BUCKET) as (endpoint, _):
        prefix = s3_night(endpoint, count)
        with fault_proxy(endpoint, latency_ms=latency_ms, methods=["GET", "HEAD", "PUT", "POST", "DELETE"]) as proxy:
            return measure("s3", prefix, work, s3_env | {"AWS_ENDPOINT_URL": proxy.endpoint})


if __name__ == "__main__":
    main()
