"""The execution plan on a GPU: fp32, fp16 and bf16 at larger batches, and the photo loop end to end.

The GPU machines lent to this project have torch, torchvision, PIL, numpy and scikit-learn but no Ray
(and no registry to install from), so this is bench/night_plan.py's measurement without Ray: each
candidate plan's images/s for both ResNets at ``--batches`` (numpy in, logits out) and the plan chosen;
fp16 and bf16 gated against fp32 on a ResNet-18 trained on the digits; and ``--photos`` camera photos
through a DataLoader, ResNet-50, the documented pattern against rayline's decoding and plan.
Run with the machine's python3 and pydantic carried as wheels; last line: one line of JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from the repository root

from bench.support.results import emit  # noqa: E402

ARCHS = ("resnet50", "resnet18")
DEVICE = {"name": "cuda"}  # --dry-run: "cpu", to try the script where there is no GPU


def model_plans(arch: str, batch: int) -> dict[str, Any]:
    import torch
    from torchvision.models import get_model

    from rayline.hardware import detect
    from rayline.ray_workloads.execution.plan import PlanPolicy, choose, torch_run

    module = get_model(arch, weights=None).to(DEVICE["name"]).eval().to(memory_format=torch.channels_last)
    probe = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    choice = choose(lambda plan: torch_run(module, plan), probe, detect(), DEVICE["name"], PlanPolicy())
    speeds = ", ".join(f"{name} {speed:,.0f}" for name, speed in choice.speeds.items())
    print(f"{arch}, batch {batch}: images/s {speeds}; chosen {choice.reason}", flush=True)
    return {"plan": choice.plan.name, "images_s": {k: round(v, 1) for k, v in choice.speeds.items()}}


def trained_gate() -> dict[str, Any]:
    from rayline.ray_workloads.execution.plan import REFERENCE, Plan, gate, torch_run
    from rayline.testing.trained_models import digits_resnet18

    module, images, _ = digits_resnet18(side=64, steps=80, device=DEVICE["name"])
    reference = torch_run(module, REFERENCE)(images)
    figures = {}
    for precision in ("fp16", "bf16"):
        result = gate(reference, torch_run(module, Plan(precision=precision))(images))  # type: ignore[arg-type]
        figures[precision] = {"agreement": result.agreement, "max_prob_diff": round(result.max_prob_diff, 5)}
        print(f"trained ResNet-18, {precision} against fp32 on {result.images} images: {figures[precision]}")
    return figures


class RaylineDecode:
    """rayline's decoding of a photo file (reduced-scale JPEG decoding where the photo is far larger)."""

    def __init__(self, paths: list[str], spec: Any) -> None:
        self.paths, self.spec = paths, spec

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Any:
        from rayline.ray_workloads.data.images import decode_image

        return index, decode_image(Path(self.paths[index]).read_bytes(), self.spec)


def photo_loop(paths: list[str], plan_side: bool) -> dict[str, Any]:
    from torch.utils.data import DataLoader
    from torchvision.models import get_model

    from bench.support.documented_loop import DocumentedDataset
    from rayline.hardware import detect
    from rayline.ray_workloads.architectures.torchvision_families import imagenet_image_spec
    from rayline.ray_workloads.execution.plan import Plan, PlanPolicy, choose, torch_run

    workers = len(os.sched_getaffinity(0))
    module = get_model("resnet50", weights=None).to(DEVICE["name"]).eval()
    dataset: Any = (
        RaylineDecode(paths, imagenet_image_spec("resnet50")) if plan_side else DocumentedDataset(paths, "resnet50")
    )
    # the same batches on both sides: a DataLoader worker builds a whole batch, so larger ones idle workers
    loader = DataLoader(dataset, batch_size=64, num_workers=workers, pin_memory=True)
    began = time.perf_counter()
    documented = Plan(channels_last=False)  # fp32 eager, as the documented pattern runs it
    run: Any = None if plan_side else torch_run(module, documented)
    plan = documented.name
    rows = 0
    for _, images in loader:
        array = np.asarray(images)
        if run is None:  # rayline: the plan measured on the night's first images
            choice = choose(lambda p: torch_run(module, p), array[:64], detect(), DEVICE["name"], PlanPolicy())
            run, plan = torch_run(module, choice.plan), choice.plan.name
        run(array).argmax(axis=1)
        rows += len(array)
    seconds = time.perf_counter() - began
    side = "rayline (reduced-scale decode, plan)" if plan_side else "documented (full decode, fp32 eager)"
    print(f"photo loop, {side}: {rows / seconds:,.1f} images/s ({rows} photos, {seconds:.1f} s, plan {plan})")
    return {"images_s": rows / seconds, "plan": plan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=2000)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/rayline-gpu-photos"))
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes: tries the script, no figures")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--only-loop", action="store_true", help="only the photo loop")
    args = parser.parse_args()
    import torch

    from rayline.hardware import detect

    if args.dry_run:
        DEVICE["name"] = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("no GPU: bench/night_plan.py is the CPU bench (--dry-run tries this one on the CPU)")
    hardware = detect()
    print(f"hardware: {hardware.describe()}, bf16 on the GPU: {hardware.gpu_bf16}; torch {torch.__version__}")
    figures: dict[str, Any] = {"gpu": hardware.gpu, "cpu_cores": len(os.sched_getaffinity(0))}
    for arch in () if args.only_loop else ARCHS:
        for batch in args.batches:
            figures[f"{arch}_b{batch}"] = model_plans(arch, batch)
    if not args.only_loop:
        figures["gate"] = trained_gate()
    from bench.support.photo_images import ensure_camera

    began = time.perf_counter()
    paths = [str(path) for path in ensure_camera(args.photos, args.folder)]
    print(f"{len(paths)} photos generated in {time.perf_counter() - began:.0f} s", flush=True)
    documented = photo_loop(paths, plan_side=False)
    rayline = photo_loop(paths, plan_side=True)
    figures["loop_documented_img_s"] = round(documented["images_s"], 1)
    figures["loop_rayline_img_s"] = round(rayline["images_s"], 1)
    figures["loop_plan"] = rayline["plan"]
    figures["loop_speedup"] = round(rayline["images_s"] / documented["images_s"], 2)
    emit("gpu_plan", figures)


if __name__ == "__main__":
    main()
