"""The capacity model, measured and checked: per-image costs here, a 2-node night predicted, run, compared.

1. ResNet-18's per-image costs with the actors' own code, one torch thread, in a process of its own.
2. A 2-node Ray cluster joined as ``RAY_ADDRESS`` would be: a calibration night gives the fixed start-up,
   the model predicts the night of ``--photos`` photos, the bench runs it (target: within 25 %).
3. The sizing table (bench/support/capacity_model.py, derived in docs/capacity.md); the GPU's forward rate
   (``--gpu-img-s``) is an assumption. What is measured and the JSON keys: bench/README.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.support.capacity_model import (  # noqa: E402
    Costs,
    Limits,
    cpu_node,
    files_per_table,
    gpu_node,
    plan,
    predict_night_s,
)
from bench.support.children import child_env, print_result, run_child, work_dir  # noqa: E402
from bench.support.inference_images import warm_page_cache  # noqa: E402
from bench.support.inference_night import resolve_champion  # noqa: E402
from bench.support.photo_images import photo_folder  # noqa: E402
from bench.support.resnet_inference import model_name, register_resnet  # noqa: E402
from bench.support.results import emit  # noqa: E402

ARCH = "resnet18"
DAY = "2026-11-28"
BLOCK = 32  # objects per task of a compute-bound night (rayline.ray_workloads.nightly.batch_inference)


# ---------------------------------------------------------------- 1. per-image costs, one core


def child_costs(spec: dict[str, Any]) -> dict[str, Any]:
    """Seconds per image of each step of a predictor actor's block, one thread, after one warm-up block."""
    import numpy as np
    import torch

    from rayline import storage
    from rayline.ray_workloads.nightly import batch_inference
    from rayline.ray_workloads.nightly.blocks import NightOutput
    from rayline.ray_workloads.nightly.pipeline import run_constants
    from rayline.ray_workloads.nightly.predictor import PredictorUDF, fetch_and_decode, write_block
    from rayline.tables.delta_tables import Night

    torch.set_num_threads(1)
    version = resolve_champion(spec["root"], model_name(ARCH))
    tables = storage.join(spec["root"], "costs")
    cfg = batch_inference.InferenceConfig(
        input_uri=spec["input"], tables_root=tables, dt=DAY, model=version, code_version="bench"
    )
    output = NightOutput(f"{tables}/predictions", f"{tables}/errors", Night(version.name, DAY), "costs", "kcosts")
    udf = PredictorUDF(version, cfg.top_k, cfg.batch_size, cfg.io_concurrency, output, run_constants(cfg))
    uris = sorted(p.as_uri() for p in Path(spec["input"]).rglob("*.jpg"))[: spec["count"]]
    spent = {"fetch_decode": 0.0, "forward": 0.0, "write": 0.0}
    measured = 0
    for start in range(0, len(uris), BLOCK):
        block = uris[start : start + BLOCK]
        stamps = [time.perf_counter()]
        etags = ["-"] * len(block)  # local files: a read has no ETag to compare
        rows = fetch_and_decode(block, etags, udf.spec, udf.io_concurrency)
        rows["uri"] = np.array(block, dtype=object)
        rows["etag"] = np.array(etags, dtype=object)
        stamps.append(time.perf_counter())
        udf.predict(rows)
        del rows["image"]
        stamps.append(time.perf_counter())
        write_block(f"p/b{start:09d}", rows, output, {**udf.constants, "plan": "eager/fp32/channels-last"})
        stamps.append(time.perf_counter())
        if start == 0:
            continue  # the warm-up block: first calls allocate and fill caches
        for step, (before, after) in zip(spent, itertools.pairwise(stamps), strict=True):
            spent[step] += after - before
        measured += len(block)
    storage.remove_tree(tables)
    return {f"{k}_s": v / measured for k, v in spent.items()} | {"images": measured}


# ---------------------------------------------------------------- 2. nights on a 2-node cluster


def child_cluster(spec: dict[str, Any]) -> dict[str, Any]:
    """A head and one worker node; a calibration night, then the measured night, from this driver."""
    import ray
    from ray.cluster_utils import Cluster

    from rayline import ray_cluster, storage
    from rayline.ray_workloads.nightly import batch_inference

    node = {"num_cpus": 2, "object_store_memory": 1 << 30}  # 2 logical CPUs a core, as rayline's embedded cluster
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(**node)
    os.environ["RAY_ADDRESS"] = cluster.address  # joined as an outside cluster: rayline ships its packages
    try:
        ray_cluster.connect()
        nodes = sum(1 for n in ray.nodes() if n["Alive"])  # type: ignore[no-untyped-call]
        version = resolve_champion(spec["root"], model_name(ARCH))
        seconds = {}
        for name in ("calibrate", "night"):
            cfg = batch_inference.InferenceConfig(
                input_uri=spec[name],
                tables_root=storage.join(spec["root"], "tables", name),
                dt=DAY,
                model=version,
                code_version="bench",
                actors=2,
                batch_size=32,
                objects_per_task=BLOCK,
            )
            began = time.perf_counter()
            result = batch_inference.run(cfg)
            seconds[name] = time.perf_counter() - began
            assert result.predictions == result.inputs, result
        return {"calibrate_s": seconds["calibrate"], "night_s": seconds["night"], "nodes": nodes}
    finally:
        ray_cluster.disconnect()
        cluster.shutdown()


def measure(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return run_child(kind, __file__, ["--child", kind, json.dumps(spec)], child_env(spec["root"]))


# ---------------------------------------------------------------- 3. the sizing table


def sizing(costs: Costs, limits: Limits) -> dict[str, dict[str, Any]]:
    """The table's rows, keyed ``<N>M_<h>h_<cpu|gpu>_<prefixes>p``: what docs/capacity.md names each figure by."""
    plans: dict[str, dict[str, Any]] = {}
    kinds = (cpu_node(costs, limits), gpu_node(costs, limits))
    for n, hours, kind in itertools.product((10_000_000, 100_000_000), (2, 6), kinds):
        p = plan(n, hours * 3600.0, kind, costs, limits)
        shares = ", ".join(f"{k} {v:.0%}" for k, v in p.shares.items())
        print(
            f"  {n / 1e6:.0f} M in {hours} h, {kind.name} at {kind.img_s:,.0f} img/s ({kind.bound_by}): "
            f"{p.nodes} nodes; limits used: {shares}; closest: {p.bites_first}; "
            f"{files_per_table(n, limits):,} files per table"
        )
        node = "gpu" if "GPU" in kind.name else "cpu"
        plans[f"{n // 1_000_000}M_{hours}h_{node}_{limits.prefixes}p"] = {
            "images": n,
            "hours": hours,
            "kind": kind.name,
            "node_img_s": round(kind.img_s, 1),
            "bound_by": kind.bound_by,
            "nodes": p.nodes,
            "shares": {k: round(v, 4) for k, v in p.shares.items()},
            "bites_first": p.bites_first,
        }
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--photos", type=int, default=1_500, help="the measured night (default 1,500)")
    parser.add_argument("--calibrate", type=int, default=64, help="the calibration night (default 64)")
    parser.add_argument("--cost-photos", type=int, default=160, help="photos the per-image costs are taken over")
    # rounded up from bench/night_scale.py's (bench/results/night_scale-2026-12-03-2core.json): 11 s of driver
    # CPU for 3,933 blocks, ~3 ms a block; compaction 21.2 s on 2 cores for 1,000,000 rows, ~0.04 ms a row
    parser.add_argument("--driver-s-per-block", type=float, default=0.004, help="bench/night_scale.py's figure")
    parser.add_argument("--compact-s-per-row", type=float, default=5e-5, help="bench/night_scale.py's figure")
    parser.add_argument("--list-keys-per-s", type=float, default=20_000.0, help="one S3 listing stream")
    parser.add_argument("--commit-s", type=float, default=0.3, help="both tables' commits of one night")
    parser.add_argument("--gpu-img-s", type=float, default=2_000.0, help="ASSUMED: one GPU's ResNet-18 rate")
    parser.add_argument("--prefixes", type=int, default=256, help="hashed key prefixes of the bucket")
    args = parser.parse_args()
    if args.child:
        kind, spec = args.child[0], json.loads(args.child[1])
        print_result(child_costs(spec) if kind == "costs" else child_cluster(spec))
        return

    work = work_dir("rlcap-")
    register_resnet(work, ARCH)
    night, calibrate = photo_folder(args.photos), photo_folder(args.calibrate)
    warm_page_cache(night, "*.jpg")
    measured = measure("costs", {"root": work, "input": str(night), "count": args.cost_photos + BLOCK})
    print(
        f"per image, one core: fetch+decode {measured['fetch_decode_s'] * 1e3:.1f} ms, "
        f"ResNet-18 forward {measured['forward_s'] * 1e3:.1f} ms, write {measured['write_s'] * 1e3:.2f} ms "
        f"(over {measured['images']} photos)"
    )
    ran = measure("cluster", {"root": work, "calibrate": str(calibrate), "night": str(night)})
    steps = {k: measured[k] for k in ("fetch_decode_s", "forward_s", "write_s")}
    flags = {k: getattr(args, k) for k in ("driver_s_per_block", "compact_s_per_row", "list_keys_per_s", "commit_s")}
    base = Costs(**steps, **flags, fixed_s=0.0)
    workers = min(2, os.cpu_count() or 1)  # single-thread actors, one a core: 2 actors on this machine's cores
    # the calibration night's seconds less what the model gives its images: the cluster's fixed start-up
    fixed = max(0.0, ran["calibrate_s"] - predict_night_s(args.calibrate, workers, base, BLOCK))
    costs = replace(base, fixed_s=fixed)
    predicted = predict_night_s(args.photos, workers, costs, BLOCK)
    ratio = ran["night_s"] / predicted
    print(
        f"{ran['nodes']}-node cluster: calibration night of {args.calibrate} photos {ran['calibrate_s']:.1f} s "
        f"(fixed start-up {fixed:.1f} s); night of {args.photos:,} photos predicted {predicted:.1f} s, "
        f"measured {ran['night_s']:.1f} s: measured / predicted {ratio:.2f} (target 0.75-1.25)"
    )
    # the sizing table: a production cluster's fixed start-up is its own (measured the same way); this one's
    plans: dict[str, dict[str, Any]] = {}
    for prefixes in (args.prefixes, 1):
        limits = Limits(gpu_img_s=args.gpu_img_s, prefixes=prefixes)
        layout = f"{prefixes} hashed key prefixes" if prefixes > 1 else "a flat prefix"
        print(f"sizing, {layout} (the GPU's forward rate, {args.gpu_img_s:,.0f} img/s, is an assumption):")
        plans |= {key: {**row, "prefixes": prefixes} for key, row in sizing(costs, limits).items()}
    figures = {
        "calibrate_s": round(ran["calibrate_s"], 2),
        "predicted_s": round(predicted, 2),
        "measured_s": round(ran["night_s"], 2),
        "predicted_vs_measured": round(ratio, 3),
        "nodes": ran["nodes"],
        "costs": asdict(costs),
        "cpu_s_per_image": round(costs.cpu_s_per_image, 6),
        "plans": plans,
    }
    emit("capacity", figures)


if __name__ == "__main__":
    main()
