"""What a shadow costs: a night's images/s with a second version scored in the same pass, against without.

Two cases on an embedded Ray cluster: an untrained ``small_cnn`` on 32 px PNGs (fetch, decode and write
dominate) and ResNet-18 on camera-sized JPEGs (the forward pass dominates). Each registers two versions
(v1 champion, v2 the shadow) and runs the same input as separate nights, without and with the shadow, in
turn (``--rounds`` pairs, the best of each kept). JSON keys: bench/README.md. Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.support, run as a script

from bench.support.results import emit  # noqa: E402


def _night(root: str, source: Path, model: Any, shadow: Any, day: int, actors: int) -> float:
    """Seconds of one night from listing to its commits (the run's own figure)."""
    from rayline.ray_workloads.execution.plan import PlanPolicy
    from rayline.ray_workloads.nightly import batch_inference

    cfg = batch_inference.InferenceConfig(
        input_uri=str(source),
        tables_root=root,
        dt=f"2026-11-{day:02d}",
        model=model,
        shadow=shadow,
        actors=actors,
        code_version="bench",
        plan=PlanPolicy(mode="off"),  # fp32 eager on both sides: the shadow's cost, not a plan's choice
    )
    result = batch_inference.run(cfg)
    assert (result.shadow is not None) == (shadow is not None)
    return result.elapsed_s


def _case(name: str, arch: str, source: Path, count: int, rounds: int, actors: int) -> dict[str, float]:
    from bench.support.inference_night import register_untrained
    from bench.support.process_tree import wait_until_idle

    root = tempfile.mkdtemp(prefix=f"rayline-shadow-{name}-")
    champion, shadow = (register_untrained(name, champion=False, root=root, arch=arch, seed=s) for s in (0, 1))
    _night(root, source, champion, None, 1, actors)  # warm-up: workers, imports, page cache
    plain, shadowed = [], []
    for r in range(rounds):
        wait_until_idle()
        plain.append(_night(root, source, champion, None, 2 + 2 * r, actors))
        wait_until_idle()
        shadowed.append(_night(root, source, champion, shadow, 3 + 2 * r, actors))
    without, with_shadow = count / min(plain), count / min(shadowed)
    figures = {
        "images": count,
        "images_per_s_without": round(without, 1),
        "images_per_s_with_shadow": round(with_shadow, 1),
        "ratio_with_over_without": round(with_shadow / without, 3),
        "shadowed_night_over_two_nights": round(min(shadowed) / (2 * min(plain)), 3),
    }
    print(
        f"{name}: {count} images, {without:.1f} images/s without a shadow, {with_shadow:.1f} with one "
        f"(ratio {figures['ratio_with_over_without']}); the shadowed night takes "
        f"{figures['shadowed_night_over_two_nights']} of two nights, one per version",
        flush=True,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits", type=int, default=20_000, help="32 px images of the digits case")
    parser.add_argument("--photos", type=int, default=300, help="camera-sized photos of the ResNet-18 case")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not the figures")
    args = parser.parse_args()
    if args.quick:
        args.digits, args.photos, args.rounds = 2_000, 64, 1

    from bench.support.inference_images import ensure_images, input_folder, warm_page_cache
    from bench.support.photo_images import photo_folder
    from rayline import ray_cluster
    from rayline.ray_workloads.nightly import batch_inference

    digits = input_folder(args.digits, ensure_images(args.digits))
    warm_page_cache(digits)
    photos = photo_folder(args.photos)
    warm_page_cache(photos, "*.jpg")
    began = time.perf_counter()
    ray_cluster.connect(preload=batch_inference.WORKER_PRELOAD)
    print(f"ray.init: {time.perf_counter() - began:.1f}s (excluded)", flush=True)
    report = {
        "digits": _case("digits", "small_cnn", digits, args.digits, args.rounds, args.actors),
        "resnet18": _case("photos", "resnet18", photos, args.photos, args.rounds, args.actors),
    }
    emit("shadow_night", {"bench": "shadow_night", **report})


if __name__ == "__main__":
    main()
