"""Batch inference throughput: nightly_inference's workload vs a plain single-process PyTorch loop.

rayline (``batch_inference.run`` on an embedded Ray cluster started as the nightly task starts it) against
the seed article's ``TorchPredictor`` loop by hand, one process, no Ray (bench/support/plain_inference.py:
the same listing, reads, ``decode_image``, batches, output files and ``prepare_for_inference``, so that Ray
is the only difference; the seed's code verbatim is timed too at the first size). An untrained
``small_cnn`` on synthetic 32 px PNGs generated once under ``$RAYLINE_BENCH_CACHE`` and read once before
timing: from a local folder (``--parts local``), a loopback moto server (``s3``), and a whole
``rayline nightly-inference`` process (``e2e``); ``--parts table`` and ``resnet`` measure their own cases.
What each figure includes: bench/README.md. ``--quick``: small sizes, a smoke test. Prints human lines,
the targets, then one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.support import resnet_inference, table_reads  # noqa: E402
from bench.support.children import child_env, print_result, run_child, work_dir  # noqa: E402
from bench.support.inference_images import CACHE, IMAGE_SIZE, ensure_images, input_folder, warm_page_cache  # noqa: E402
from bench.support.inference_night import DAY, measure_nights, register_untrained, resolve_champion  # noqa: E402
from bench.support.inference_report import commit_share, print_pair, rate  # noqa: E402
from bench.support.inference_s3 import BUCKET, loopback_s3, server_ceiling, upload  # noqa: E402
from bench.support.plain_inference import BATCH_SIZE, choose_torch_threads, plain_loop  # noqa: E402
from bench.support.process_tree import watch_tree  # noqa: E402
from bench.support.results import emit  # noqa: E402


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    import rayline.ray_workloads.data.images  # noqa: F401  (imports happen before the clock starts)
    from bench.support.resnet_plain import Reader
    from rayline import storage

    version = resolve_champion(spec["root"], "digits")
    prepared = not spec.get("seed_verbatim")
    threads = choose_torch_threads(version, prepared)
    out_dir = storage.join(spec["root"], "plain", spec["name"])
    with watch_tree(sample=False) as cpu:
        began = time.perf_counter()
        objects = storage.list_objects(spec["input"])
        rows = plain_loop(objects, Reader(), version, out_dir, prepared)
        seconds = time.perf_counter() - began
    assert rows == len(objects) == spec["count"], (rows, len(objects), spec["count"])
    storage.remove_tree(out_dir)
    cores = {k: cpu[k] for k in ("cores", "others_cores")}
    return {"seconds": seconds, "images_s": rows / seconds, "torch_threads": threads, **cores}


def child_rayline(spec: dict[str, Any]) -> dict[str, Any]:
    version = resolve_champion(spec["root"], "digits")
    return measure_nights(spec, version, spec["runs"], batch_size=BATCH_SIZE)


def child_main(spec: dict[str, Any]) -> None:
    if spec.get("s3"):
        os.environ["AWS_ENDPOINT_URL"] = spec["s3"]
    if spec["kind"].startswith("resnet-"):
        result = resnet_inference.child(spec)
    else:
        result = child_plain(spec) if spec["kind"] == "plain" else child_rayline(spec)
    print_result(result)


def measure(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One measurement in a fresh process (its own Ray cluster, its own memory)."""
    return run_child(f"measurement {spec['kind']} {spec['name']}", __file__, ["--child", json.dumps(spec)], env)


def end_to_end(root: str, images: list[Path], count: int, env: dict[str, str]) -> tuple[float, str]:
    """Wall time of a whole ``rayline nightly-inference`` process on ``count`` images."""
    incoming = Path(root) / "incoming" / f"dt={DAY}"
    for source in images[:count]:
        target = incoming / source.relative_to(CACHE / "images")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    rayline = Path(sys.executable).parent / "rayline"
    command = [str(rayline), "nightly-inference", "--date", DAY]
    began = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"rayline nightly-inference failed (exit {proc.returncode})")
    summary = next((line.strip() for line in proc.stdout.splitlines() if "inputs →" in line), "")
    return seconds, summary


def bench_local(
    work: str, images: list[Path], sizes: tuple[int, int], rss_sizes: tuple[int, int], env: dict[str, str]
) -> dict[str, float]:
    """Throughput ratios at ``sizes`` and peak RSS at ``rss_sizes``, images in a local folder."""
    figures: dict[str, float] = {}
    peaks: dict[int, dict[str, float]] = {}
    for count in sorted({*sizes, *rss_sizes}):
        folder = input_folder(count, images)
        warm_page_cache(folder)
        base = {"root": work, "input": str(folder), "count": count, "name": f"local-{count}"}
        ray_ = measure({**base, "kind": "rayline", "runs": 1 if count >= 50_000 else 2}, env)
        peaks[count] = ray_["runs"][0]
        if count in sizes:
            plain = measure({**base, "kind": "plain"}, env)
            figures[f"ratio_{'small' if count == sizes[0] else 'large'}"] = print_pair(
                "local folder", count, plain, ray_
            )
            if count == sizes[0]:
                figures["commit_share_small"] = commit_share(ray_, count)
        else:
            print(f"local folder, {count} images: rayline {rate(ray_):.1f} images/s (for peak RSS)", flush=True)
        if count == sizes[0]:
            verbatim = measure({**base, "kind": "plain", "seed_verbatim": True}, env)
            print(
                f"  for reference, the plain loop with the model as loaded (the seed's code verbatim): "
                f"{verbatim['images_s']:.1f} images/s; rayline / that = {rate(ray_) / verbatim['images_s']:.2f}"
            )
    for count in rss_sizes:
        peak = peaks[count]
        print(
            f"peak memory of the rayline process tree at {count}: RSS {peak['rss_mb']:.0f} MB, "
            f"PSS {peak['pss_mb']:.0f} MB, {peak['processes']:.0f} processes"
        )
    figures["rss_small_mb"], figures["rss_large_mb"] = (peaks[c]["rss_mb"] for c in rss_sizes)
    return figures


def bench_s3(work: str, images: list[Path], count: int, env: dict[str, str]) -> float:
    """rayline vs the plain loop reading one GET after another, images on a loopback S3 server."""
    with loopback_s3(env, BUCKET) as (endpoint, server_pid):
        uri = upload(endpoint, BUCKET, f"incoming/dt={DAY}", images[:count], CACHE / "images")
        base = {"root": work, "input": uri, "count": count, "s3": endpoint, "name": "s3"}
        ray_ = measure({**base, "kind": "rayline", "runs": 1}, env)
        plain = measure({**base, "kind": "plain"}, env)
        ratio = print_pair("loopback S3 (moto), plain = one GET after another", count, plain, ray_)
        gets_s, server_ms = server_ceiling(endpoint, uri, server_pid)
        # Every image costs the server one GET, and it serves GETs from one Python process
        # (one core at most, GIL-bound): no client can go faster than that, whatever it does.
        most_gets_s = max(gets_s, 1000 / server_ms)
        print(
            f"  the server's ceiling: {gets_s:.0f} GET/s with 32 concurrent GETs and nothing else to do; it spends "
            f"{server_ms:.1f} ms of CPU per GET in one Python process, so at most {1000 / server_ms:.0f} GET/s "
            f"even with a core of its own\n"
            f"  so against this server no client can beat the plain loop by more than "
            f"{most_gets_s:.0f} / {plain['images_s']:.0f} = {most_gets_s / plain['images_s']:.2f}x"
        )
        return ratio


def bench_end_to_end(work: str, images: list[Path], count: int, env: dict[str, str]) -> float:
    primed = (CACHE / "prefect-home").exists()
    seconds, summary = end_to_end(work, images, count, env)
    if not primed:  # the first ever run also created Prefect's database: time a second one
        print(f"end to end (Prefect's database created): {seconds:.1f}s")
        seconds, summary = end_to_end(work, images, count, env)
    print(f"end to end, `rayline nightly-inference` on {count} images: {seconds:.1f}s whole process")
    print(f"  ({summary})", flush=True)
    return seconds


def _pair(text: str) -> tuple[int, int]:
    small, large = (int(s) for s in text.split(","))
    return small, large


def images_needed(args: argparse.Namespace, parts: set[str]) -> int:
    """The most images one of the chosen measurements reads: only that many need generating."""
    counts = {"e2e": [args.e2e_images], "local": [*args.sizes, *args.rss_sizes], "s3": [args.s3_size]}
    return max((count for part in parts & counts.keys() for count in counts[part]), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the bench, not the figures")
    parser.add_argument("--sizes", type=_pair, default=(20_000, 100_000), help="sizes of the two throughput ratios")
    parser.add_argument("--rss-sizes", type=_pair, default=(10_000, 100_000), help="small,large size for peak RSS")
    parser.add_argument("--s3-size", type=int, default=5000)
    parser.add_argument("--e2e-images", type=int, default=20)
    parser.add_argument(
        "--parts", default="local,s3,e2e,table,resnet", help="which measurements to run (comma-separated)"
    )
    parser.add_argument("--table-nights", type=int, default=30, help="--parts table: nights in the large table")
    parser.add_argument("--table-rows", type=int, default=20_000, help="--parts table: rows per night")
    parser.add_argument("--table-repeats", type=int, default=7, help="--parts table: timed reads of each night")
    resnet_inference.add_arguments(parser)
    args = parser.parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return
    if args.quick:
        args.sizes, args.rss_sizes, args.s3_size = (1000, 3000), (1000, 3000), 300
        args.resnet_sizes = [200, 600]
        args.table_nights, args.table_rows, args.table_repeats = 5, 2000, 3
    parts = set(args.parts.split(","))

    images = ensure_images(images_needed(args, parts)) if parts & {"local", "s3", "e2e"} else []
    work = work_dir("rlbi-")
    env = child_env(work) | {
        "PREFECT_HOME": str(CACHE / "prefect-home"),  # an ephemeral API of our own, DB reused between runs
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    local: dict[str, float] = {}
    resnet: dict[str, Any] = {}
    table: dict[str, float] = {}
    s3_ratio = e2e_s = None
    try:
        register_untrained("digits", IMAGE_SIZE, root=work)
        if "local" in parts:
            local = bench_local(work, images, args.sizes, args.rss_sizes, env)
        if "s3" in parts:
            s3_ratio = bench_s3(work, images, args.s3_size, env)
        if "e2e" in parts:
            e2e_s = bench_end_to_end(work, images, args.e2e_images, env)
        if "table" in parts:
            table = table_reads.bench_table(work, args.table_nights, args.table_rows, args.table_repeats)
        if "resnet" in parts:
            resnet = resnet_inference.bench_resnet(work, args, env, measure)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def rounded(value: float | None, digits: int | None = 3) -> float | None:
        return None if value is None else round(value, digits)

    rss_ratio = local["rss_large_mb"] / local["rss_small_mb"] if local else None
    result = {
        "ratio_20k": rounded(local.get("ratio_small")),
        "ratio_100k": rounded(local.get("ratio_large")),
        "ratio_s3_vs_seed": rounded(s3_ratio),
        "rss_10k_mb": rounded(local.get("rss_small_mb"), None),
        "rss_100k_mb": rounded(local.get("rss_large_mb"), None),
        "rss_ratio": rounded(rss_ratio),
        "e2e_20_images_s": rounded(e2e_s, 1),
        "commit_share_20k": rounded(local.get("commit_share_small")),
        "read_night1_s": rounded(table.get("read_night1_s"), 4),
        "read_night30_s": rounded(table.get("read_night30_s"), 4),
        "read_night30_vs_1": rounded(table.get("read_night30_vs_1")),
        **resnet,
    }
    print(
        "targets: ratio_20k >= 0.9, ratio_100k >= 1.0, ratio_s3_vs_seed >= 3, rss_ratio <= 1.3, "
        "commit_share_20k <= 0.10, read_night30_vs_1 <= 2; "
        "resnet_ratio_2k >= 0.9, resnet_ratio_10k >= 0.95, resnet_rss_ratio <= 1.3"
        + (" (--quick: not the issue's sizes)" if args.quick else "")
    )
    emit("batch_inference", result)


if __name__ == "__main__":
    main()
