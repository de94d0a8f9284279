"""Nights and serving at the speed of the hardware: rayline's execution plan and reduced-scale decoding
against the plain loop of Ray Data's documented pattern, in one run on one machine.

Prints the ISA first (the first night's targets depend on it: with AMX, ResNet-50 >= 4x and ResNet-18 >= 3x
the plain loop; with AVX-512-BF16, >= 3x and >= 2.5x; with neither, >= 1.5x). Then, in fresh processes on the
same camera-sized photos, the documented loop (bench/support/documented_loop.py) against rayline's night with
its defaults (a version's first night, its plan measured when register-model made it; then its next night);
the chosen precision's top-1 agreement on a trained ResNet-18; a photo's decode cost; and ``POST /predict``
saturated with the plan and without. The models are random backbones with a fitted 2-class head
(bench/support/probe_head.py): a ``weights=None`` head's tied logits fail the gate whatever the plan. What
each figure is and the JSON keys: bench/README.md. Where ``torch.cuda.is_available()`` both nights run on the
GPU too; nothing needs one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from the repository root

from bench.support.children import print_result, run_child  # noqa: E402
from bench.support.results import emit  # noqa: E402
from bench.support.timing import run_seconds  # noqa: E402

if TYPE_CHECKING:
    from rayline.ray_workloads.execution.plan import Precision

ARCHS = ("resnet50", "resnet18")
SERVE_CONNECTIONS = 8
# the first night's speedup over the plain loop, by the CPU's fastest reduced-precision path
TARGETS = {
    "amx": {"resnet50": 4.0, "resnet18": 3.0},
    "avx512_bf16": {"resnet50": 3.0, "resnet18": 2.5},
    "neither": {"resnet50": 1.5, "resnet18": 1.5},
}


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    from bench.support.documented_loop import documented_loop
    from bench.support.resnet_inference import _version

    version = _version(spec)
    paths = sorted(str(p) for p in Path(spec["input"]).rglob("*.jpg"))
    began, cpu_before = time.perf_counter(), _cpu_s()
    rows = documented_loop(paths, version, Path(spec["root"]) / "plain" / f"{spec['name']}.parquet", spec["batch"])
    seconds = time.perf_counter() - began
    assert rows == spec["count"], (rows, spec["count"])
    # its process's CPU and its DataLoader workers' (ended and waited for when the loop is done)
    return {"seconds": seconds, "images_s": rows / seconds, "core_seconds": _cpu_s() - cpu_before}


def _cpu_s() -> float:
    import resource

    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from bench.support import resnet_inference

    if spec["kind"] == "plain":
        return child_plain(spec)
    return resnet_inference.child_rayline(spec)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One side in a fresh process (its own Ray cluster, its own memory)."""
    return run_child(f"measurement {spec['kind']} {spec['name']}", __file__, ["--child", json.dumps(spec)])


def night(work: str, arch: str, folder: Path, count: int, gpu: bool) -> dict[str, Any]:
    """The plain loop and rayline's night for ``arch`` over ``folder``; their figures and the plan chosen."""
    from bench.support.resnet_inference import choose_settings, register_resnet

    cores = os.cpu_count() or 1
    root = str(Path(work) / arch)
    register_resnet(root, arch, photo_head=True)  # fresh: the night measures its plan, as a first night does
    settings = choose_settings(cores, gpu=gpu, overrides={"batch_size": 64} if gpu else None)
    base = {"root": root, "arch": arch, "input": str(folder), "count": count, "name": f"{arch}-{count}"}
    night_spec = {**base, "kind": "rayline", "settings": asdict(settings), "gpu": gpu}
    # the first night of a version register-model made, its plan measured then (on a GPU: in the night)
    rayline = measure({**night_spec, "registered": not gpu})
    # the next night of the version: its plan (and an OpenVINO plan's converted model) read from the cache
    again = measure({**night_spec, "name": f"{base['name']}-again"})
    plain = measure({**base, "kind": "plain", "batch": settings.batch_size, "gpu": gpu})
    plans = rayline["plans"]
    chosen = sorted(plans) or ["none recorded"]
    speedup = rayline["images_s"] / plain["images_s"]
    print(f"{arch}, {count} photos{' (GPU)' if gpu else ''}:")
    print(f"  plain loop {plain['images_s']:6.1f} images/s ({plain['seconds']:.1f} s)")
    print(f"  rayline    {rayline['images_s']:6.1f} images/s ({rayline['seconds']:.1f} s; phases {rayline['phases']})")
    for name in chosen:
        record = plans.get(name, {})
        print(f"  plan {name}: {record.get('reason', '')}")
        print(f"    images/s measured: {record.get('images_per_s')}; prepared in {record.get('prepare_s')} s")
    cached = again["images_s"] / plain["images_s"]
    print(f"  next night (plan cached) {again['images_s']:6.1f} images/s ({again['seconds']:.1f} s): {cached:.2f}")
    print(f"  speedup {speedup:.2f} (first night, measuring its plan), {cached:.2f} (next night)", flush=True)
    per_core = {side: count / max(figures["core_seconds"], 1e-9) for side, figures in
                (("plain", plain), ("first", rayline), ("next", again))}  # fmt: skip
    print(f"  images per core-second: plain loop {per_core['plain']:.2f}, first night {per_core['first']:.2f}, "
          f"next night {per_core['next']:.2f}", flush=True)  # fmt: skip
    return {"plan": ", ".join(chosen), "speedup": speedup, "cached": cached, "plain": plain, "rayline": rayline,
            "per_core": per_core}  # fmt: skip


def trained_agreement(precision: Precision) -> tuple[float, float]:
    """Top-1 agreement and largest top-class probability change of ``precision`` against fp32 on a trained
    ResNet-18 (digits, 64 px, 297 held-out images)."""
    from rayline.ray_workloads.execution.plan import REFERENCE, Plan, gate, torch_run
    from rayline.testing.trained_models import digits_resnet18

    module, images, labels = digits_resnet18(side=64, steps=80)
    reference = torch_run(module, REFERENCE)(images)
    result = gate(reference, torch_run(module, Plan(precision=precision))(images))
    accuracy = float((reference.argmax(axis=1) == labels).mean())
    print(
        f"trained ResNet-18 (digits, 64 px, held-out accuracy {accuracy:.3f}): {precision} against fp32 on "
        f"{result.images} images: top-1 agreement {result.agreement:.4f}, top-class probability within "
        f"{result.max_prob_diff:.4f}"
    )
    return result.agreement, result.max_prob_diff


def decode_costs(repeats: int) -> dict[int, dict[str, float]]:
    """ms to decode and transform one camera photo of each size, each way a plan may decode (median of repeats)."""
    import numpy as np

    from rayline.ray_workloads.architectures.build import imagenet_image_spec
    from rayline.ray_workloads.data.images import decode_image
    from rayline.seed import camera_photo

    spec = imagenet_image_spec("resnet50").model_copy(update={"draft": True})
    costs = {}
    for megapixels in (1, 3, 12):
        data = camera_photo(megapixels, np.random.default_rng(megapixels))
        figures = {
            decode: 1000 * statistics.median(run_seconds(partial(decode_image, data, spec, decode), repeats))
            for decode in ("full", "2x", "1x")
        }
        costs[megapixels] = figures
        print(
            f"decode + transform, {megapixels:2d} MP ({len(data) / 1e6:.1f} MB): full {figures['full']:6.1f} ms, "
            f"2x {figures['2x']:6.1f} ms (x{figures['full'] / figures['2x']:.2f}), "
            f"1x {figures['1x']:6.1f} ms (x{figures['full'] / figures['1x']:.2f})"
        )
    return costs


def decode_agreement(work: str, folder: Path) -> float:
    """Top-1 agreement of the 1x decode with full decoding, both fp32, over every bench photo, on the
    photo-head ResNet-18 the nights ran (its answers are not near-certain, unlike the digits')."""
    import numpy as np

    from bench.support.resnet_inference import _version
    from rayline.ray_workloads.data.images import decode_image
    from rayline.ray_workloads.execution.interface import load_version

    version = _version({"root": str(Path(work) / "resnet18"), "arch": "resnet18"})
    model, spec = load_version(version), version.image_spec
    agree = total = 0
    paths = sorted(folder.rglob("*.jpg"))
    for start in range(0, len(paths), 32):
        photos = [p.read_bytes() for p in paths[start : start + 32]]
        full = model.probabilities(np.stack([decode_image(p, spec, "full") for p in photos])).argmax(axis=1)
        reduced = model.probabilities(np.stack([decode_image(p, spec, "1x") for p in photos])).argmax(axis=1)
        agree, total = agree + int((full == reduced).sum()), total + len(photos)
    print(f"1x decode against full decoding (fp32, photo-head ResNet-18): top-1 agreement {agree / total:.4f} "
          f"on {total} photos")  # fmt: skip
    return agree / total


def serving(work: str, seconds: float) -> dict[str, dict[str, float]]:
    """/predict saturated with the plan (auto) and without (off), ResNet-18, a fresh instance each."""
    import numpy as np

    from bench.support.http_load import saturate
    from bench.support.resnet_inference import _version, register_resnet
    from rayline import ray_cluster
    from rayline.ray_workloads.execution.plan import PlanPolicy
    from rayline.ray_workloads.serving import control
    from rayline.ray_workloads.serving.config import ServeConfig
    from rayline.seed import camera_photo
    from rayline.testing.s3_server import free_port

    root = str(Path(work) / "serve")
    register_resnet(root, "resnet18", photo_head=True)
    version = _version({"root": root, "arch": "resnet18"})
    body = camera_photo(1, np.random.default_rng(7))
    figures = {}
    ray_cluster.connect()
    try:
        for label, policy in (("plan", PlanPolicy()), ("fp32", PlanPolicy(mode="off"))):
            cfg = ServeConfig(name=f"bench-{label}", port=free_port(), plan=policy)
            control.start(cfg)
            try:
                control.deploy_version(version, cfg)
                control.set_weights({version.version: 100.0}, cfg)
                saturate(cfg.port, "/predict", body, SERVE_CONNECTIONS, 3.0)  # warm-up: replica, batching
                result = saturate(cfg.port, "/predict", body, SERVE_CONNECTIONS, seconds)
            finally:
                control.shutdown(cfg)
            figures[label] = {"rps": result.rps, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms}
            print(
                f"/predict, {label}: {result.rps:.1f} req/s, p50 {result.p50_ms:.0f} ms, p99 {result.p99_ms:.0f} ms, "
                f"{result.errors} errors ({result.client})",
                flush=True,
            )
    finally:
        ray_cluster.disconnect()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--photos", type=int, default=480, help="photos of mixed sizes in each night")
    parser.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--serve-seconds", type=float, default=20.0)
    parser.add_argument("--decode-repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="40 photos, 5 s of serving: a smoke test")
    args = parser.parse_args()
    if args.child:
        print_result(child(json.loads(args.child)))
        return
    if args.quick:
        args.photos, args.serve_seconds, args.decode_repeats = 40, 5.0, 3
    os.environ.pop("RAY_ADDRESS", None)  # always embedded clusters of our own
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import torch

    from bench.support.photo_images import camera_folder
    from rayline.hardware import detect

    hardware = detect()
    fast = hardware.cpu_bf16
    row = "amx" if hardware.amx else "avx512_bf16" if fast else "neither"
    print(f"ISA: {hardware.describe()}; reduced-precision fast path on the CPU: {'yes' if fast else 'no'}")
    folder = camera_folder(args.photos)
    figures: dict[str, Any] = {
        "isa": list(hardware.isa), "cpu": hardware.cpu_model, "photos": args.photos, "target_row": row
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rayline-bench-plan-") as work:
        for arch in args.archs:
            result = night(work, arch, folder, args.photos, gpu=False)
            target = TARGETS[row][arch]
            met = "met" if result["speedup"] >= target else "NOT met"
            print(f"  target {target}x ({met} by the first night; {result['cached']:.2f} the next)")
            figures[f"plan_{arch}"] = result["plan"]
            figures[f"speedup_{arch}"] = round(result["speedup"], 3)
            figures[f"speedup_{arch}_next_night"] = round(result["cached"], 3)
            figures[f"first_over_next_{arch}"] = round(result["speedup"] / result["cached"], 3)
            figures[f"img_s_{arch}"] = round(result["rayline"]["images_s"], 1)
            figures[f"plain_img_s_{arch}"] = round(result["plain"]["images_s"], 1)
            for side, rate in result["per_core"].items():  # what a core-hour buys: docs/capacity.md's cost
                figures[f"img_per_core_s_{arch}_{side}"] = round(rate, 3)
            if torch.cuda.is_available():
                on_gpu = night(work, f"{arch}", folder, args.photos, gpu=True)
                figures[f"gpu_plan_{arch}"], figures[f"gpu_speedup_{arch}"] = on_gpu["plan"], on_gpu["speedup"]
        # the chosen plan's precision; where fp32 was chosen, its CPU candidate's (what the gate weighed)
        chosen = figures.get("plan_resnet18", "eager/fp32")
        precision: Precision = "fp16" if "fp16" in chosen else "bf16"
        agreement, prob_diff = trained_agreement(precision)
        figures["top1_agreement_resnet18"] = round(agreement, 4)
        figures["max_prob_diff_resnet18"] = round(prob_diff, 4)
        costs = decode_costs(args.decode_repeats)
        for mp, cost in costs.items():
            figures[f"decode_speedup_{mp}mp"] = round(cost["full"] / cost["2x"], 2)
            for decode, ms in cost.items():
                figures[f"decode_ms_{mp}mp_{decode}"] = round(ms, 1)
        if "resnet18" in args.archs:
            figures["decode_1x_top1_agreement_resnet18"] = round(decode_agreement(work, folder), 4)
        served = serving(work, args.serve_seconds)
    figures["serve_rps_ratio"] = round(served["plan"]["rps"] / served["fp32"]["rps"], 3)
    figures["serve_p99_ms"] = round(served["plan"]["p99_ms"], 1)
    figures["serve_p99_ms_fp32"] = round(served["fp32"]["p99_ms"], 1)
    figures["serve_rps"] = round(served["plan"]["rps"], 1)
    emit("night_plan", figures)


if __name__ == "__main__":
    main()
