"""The compute-bound case of the batch-inference bench (``--parts resnet``): ResNet on real-photo JPEGs.

rayline's night with the settings of :func:`choose_settings` against a plain DataLoader loop
(bench/support/resnet_plain.py), from a local folder and from a loopback moto server; on a machine with a
GPU both sides run a second time on it. The model, the photos, what each figure includes and the JSON
keys: bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.support.inference_night import DAY, measure_nights, resolve_champion
from bench.support.inference_report import cores as _cores

ARCHS = ("resnet18", "resnet50")
BUCKET = "rayline-bench-photos"
MODEL_CODE_VERSION = "bench"


@dataclass(frozen=True)
class RaylineSettings:
    """The ``InferenceConfig`` fields this bench chooses (everything else stays at its default)."""

    actors: int
    cpus_per_actor: float
    gpus_per_actor: float
    batch_size: int
    objects_per_task: int

    def describe(self) -> str:
        from rayline.ray_workloads.execution.interface import torch_threads

        gpus = f", {self.gpus_per_actor:g} GPU each" if self.gpus_per_actor else ""
        threads = torch_threads(self.cpus_per_actor)  # what PredictorUDF sets from the actor's CPUs
        return (
            f"{self.actors} actors x {self.cpus_per_actor:g} CPU{gpus}, {threads} torch thread(s) each, "
            f"batch {self.batch_size}, {self.objects_per_task} objects per task"
        )


def choose_settings(cores: int, gpu: bool, overrides: dict[str, Any] | None = None) -> RaylineSettings:
    """rayline's settings for a compute-bound model on ``cores`` cores, ``overrides`` on top.

    One single-thread actor per core at 0.5 CPU each (the embedded cluster declares 2 logical CPUs a core:
    a fractional share leaves room for Ray Data's own tasks), batch 32, 32 objects per task; on a GPU the
    actors share it. Why each, with the figures: bench/README.md.
    """
    chosen = RaylineSettings(
        actors=max(1, cores),
        cpus_per_actor=0.5,
        gpus_per_actor=_gpu_share(cores) if gpu else 0.0,
        batch_size=32,
        objects_per_task=32,
    )
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "actors" in given and gpu:
        given.setdefault("gpus_per_actor", _gpu_share(given["actors"]))
    return RaylineSettings(**{**asdict(chosen), **given})


def _gpu_share(actors: int) -> float:
    """1/actors of one GPU, rounded down to Ray's resource precision (1e-4) so that they all fit on it."""
    return math.floor(10_000 / max(1, actors)) / 10_000


def model_name(arch: str) -> str:
    return f"photos-{arch}"


def register_resnet(root: str, arch: str, photo_head: bool = False) -> None:
    """``arch`` with random weights, saved as a state dict and registered as an outside model (champion);
    ``photo_head``: with a 2-class head fitted on its features of the sample photos (bench/support/probe_head.py)."""
    import torch

    from bench.support.probe_head import fit_photo_head
    from rayline.models import registry
    from rayline.ray_workloads.architectures.build import (
        build_model,
        imagenet_classes,
        imagenet_image_spec,
        state_dict_bytes,
    )
    from rayline.specs import ModelSpec, WeightsSource

    os.environ["RAYLINE_STORAGE"] = root
    classes = imagenet_classes(arch)
    torch.manual_seed(0)
    model = build_model(ModelSpec(arch=arch, num_classes=len(classes)))
    if photo_head:
        classes = fit_photo_head(model, imagenet_image_spec(arch))
    spec = ModelSpec(arch=arch, num_classes=len(classes))
    saved = Path(root) / "outside" / f"{arch}-random.pt"  # what a user would hand over
    saved.parent.mkdir(parents=True, exist_ok=True)
    weights = state_dict_bytes(model)
    saved.write_bytes(weights)
    version = registry.register(
        model_name(arch),
        weights,
        model_spec=spec,
        image_spec=imagenet_image_spec(arch),
        classes=classes,
        metrics={},
        code_version=MODEL_CODE_VERSION,
        weights_source=WeightsSource(
            uri=saved.as_uri(), sha256=hashlib.sha256(weights).hexdigest(), size_bytes=len(weights)
        ),
    )
    registry.set_alias(model_name(arch), registry.CHAMPION, version.version, "bench")


def _version(spec: dict[str, Any]) -> Any:
    return resolve_champion(spec["root"], model_name(spec["arch"]))


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure the plain loop (in a process of its own)."""
    import torch

    import rayline.ray_workloads.data.images  # noqa: F401  (imports before the clock starts, as on the rayline side)
    from bench.support.process_tree import watch_tree
    from bench.support.resnet_plain import plain_loop
    from rayline import storage

    version = _version(spec)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    cfg = {
        "gpu": spec["gpu"],
        "batch_size": spec["settings"]["batch_size"],
        "objects_per_file": spec["settings"]["objects_per_task"],
        "workers": cores,
    }
    out_dir = storage.join(spec["root"], "plain", spec["name"])
    with watch_tree() as figures:
        began = time.perf_counter()
        objects = storage.list_objects(spec["input"])
        rows = plain_loop(objects, version, out_dir, cfg)
        seconds = time.perf_counter() - began
    assert rows == len(objects) == spec["count"], (rows, len(objects), spec["count"])
    storage.remove_tree(out_dir)
    return {**figures, "seconds": seconds, "images_s": rows / seconds, "torch_threads": cores, "workers": cores}


def child_rayline(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure ``batch_inference.run`` with the chosen settings (in a process of its own)."""
    measured = measure_nights(spec, _version(spec), **spec["settings"])
    return {**measured["runs"][0], "connect_s": measured["connect_s"], "idle_wait_s": measured["idle_wait_s"]}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    return child_plain(spec) if spec["kind"] == "resnet-plain" else child_rayline(spec)


Measure = Callable[[dict[str, Any], dict[str, str]], dict[str, Any]]


@dataclass
class Pair:
    """One size on one storage (on one device): both sides' figures."""

    storage: str
    count: int
    device: str
    plain: dict[str, Any]
    rayline: dict[str, Any]

    @property
    def ratio(self) -> float:
        return float(self.rayline["images_s"]) / float(self.plain["images_s"])


def _memory(figures: dict[str, Any]) -> str:
    return f"peak RSS {figures['rss_mb']:.0f} MB, PSS {figures['pss_mb']:.0f} MB, {figures['processes']:.0f} processes"


def print_pair(pair: Pair) -> None:
    plain, ray_ = pair.plain, pair.rayline
    print(f"{pair.storage}, {pair.count} photos, {pair.device}:")
    print(
        f"  plain loop {plain['images_s']:7.1f} images/s ({plain['seconds']:.1f}s; torch threads "
        f"{plain['torch_threads']}, {plain['workers']} DataLoader workers; {_cores(plain)}; {_memory(plain)})"
    )
    print(f"  rayline    {ray_['images_s']:7.1f} images/s ({ray_['seconds']:.1f}s; {_cores(ray_)}; {_memory(ray_)})")
    print(f"    phases (s): {ray_['phases']}; ray.init {ray_['connect_s']:.1f}s (not counted)")
    print(f"  ratio rayline / plain {pair.ratio:.2f}", flush=True)


def _sizes_on(
    label: str,
    inputs: Iterator[tuple[int, str, dict[str, Any]]],
    base: dict[str, Any],
    settings: dict[str, RaylineSettings],
    env: dict[str, str],
    measure: Measure,
) -> list[Pair]:
    """Both sides at each size of ``inputs`` ((count, input URI, extra spec fields)), on each device."""
    pairs = []
    for count, uri, extra in inputs:
        for device, chosen in settings.items():
            spec = {
                **base,
                **extra,
                "input": uri,
                "count": count,
                "gpu": device == "gpu",
                "settings": asdict(chosen),
                "name": f"{label}-{count}-{device}",
            }
            ray_ = measure({**spec, "kind": "resnet-rayline"}, env)
            plain = measure({**spec, "kind": "resnet-plain"}, env)
            pairs.append(Pair(label, count, device, plain, ray_))
            print_pair(pairs[-1])
    return pairs


def _local_inputs(sizes: list[int]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    from bench.support.inference_images import warm_page_cache
    from bench.support.photo_images import photo_folder

    for count in sizes:
        folder = photo_folder(count)
        warm_page_cache(folder, "*.jpg")
        yield count, str(folder), {}


def _s3_inputs(sizes: list[int], env: dict[str, str]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """Each size under a prefix of its own in a bucket of a loopback moto server (started here, stopped after)."""
    from bench.support.inference_s3 import loopback_s3, upload
    from bench.support.photo_images import PHOTOS, ensure_photos

    with loopback_s3(env, BUCKET) as (endpoint, _):
        for count in sizes:
            uri = upload(endpoint, BUCKET, f"photos-{count}/dt={DAY}", ensure_photos(count), PHOTOS)
            yield count, uri, {"s3": endpoint}


def bench_resnet(work: str, args: argparse.Namespace, env: dict[str, str], measure: Measure) -> dict[str, Any]:
    """Run the case as ``args`` (see :func:`add_arguments`) say; returns the closing JSON's ``resnet_*`` keys."""
    import torch

    arch, sizes = args.arch, sorted(args.resnet_sizes)
    storages = ["local", "s3"] if args.resnet_storage == "both" else [args.resnet_storage]
    overrides = {
        k: getattr(args, f"resnet_{k}") for k in ("actors", "batch_size", "objects_per_task", "cpus_per_actor")
    }
    cores = os.cpu_count() or 1
    settings = {"cpu": choose_settings(cores, gpu=False, overrides=overrides)}
    if torch.cuda.is_available():  # exercised only where there is one; nothing here needs it
        settings["gpu"] = choose_settings(cores, gpu=True, overrides=overrides)
    register_resnet(work, arch)
    print(f"compute-bound case: {arch}, random weights, ImageNet preprocessing; {cores} cores")
    for device, chosen in settings.items():
        print(f"  rayline settings ({device}): {chosen.describe()}")
    print(f"  plain: DataLoader with {cores} workers, torch threads {cores}, same batch size", flush=True)
    base = {"root": work, "arch": arch}
    pairs: list[Pair] = []
    for where in storages:
        inputs = _local_inputs(sizes) if where == "local" else _s3_inputs(sizes, env)
        pairs += _sizes_on(where, inputs, base, settings, env, measure)
    return summarize(pairs, sizes, storages, settings)


def summarize(
    pairs: list[Pair], sizes: list[int], storages: list[str], settings: dict[str, RaylineSettings]
) -> dict[str, Any]:
    """The JSON keys: ratios, RSS ratio and images/s of the first storage measured (local unless only S3)."""
    small, large = sizes[0], sizes[-1]

    def find(where: str, count: int, device: str = "cpu") -> Pair | None:
        return next((p for p in pairs if (p.storage, p.count, p.device) == (where, count, device)), None)

    def ratio(pair: Pair | None) -> float | None:
        return None if pair is None else round(pair.ratio, 3)

    def img_s(pair: Pair | None) -> float | None:
        return None if pair is None else round(float(pair.rayline["images_s"]), 1)

    main = storages[0]
    lo, hi = find(main, small), find(main, large)
    rss_ratio = None
    if lo is not None and hi is not None:
        rss_ratio = hi.rayline["rss_mb"] / lo.rayline["rss_mb"]
        print(
            f"peak RSS of rayline's process tree ({main}): {hi.rayline['rss_mb']:.0f} MB at {large} / "
            f"{lo.rayline['rss_mb']:.0f} MB at {small} = {rss_ratio:.2f}"
        )
    return {
        "resnet_ratio_2k": ratio(lo),
        "resnet_ratio_10k": ratio(hi),
        "resnet_rss_ratio": None if rss_ratio is None else round(rss_ratio, 3),
        "resnet_img_s_10k": img_s(hi),
        "resnet_s3_ratio_2k": ratio(find("s3", small)),
        "resnet_s3_ratio_10k": ratio(find("s3", large)),
        "resnet_gpu_ratio_10k": ratio(find(main, large, "gpu")),
        "resnet_gpu_img_s_10k": img_s(find(main, large, "gpu")),
        "resnet_storage": main,
        "resnet_sizes": [small, large],
        "resnet_settings": asdict(settings["cpu"]),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("compute-bound case (--parts resnet)")
    group.add_argument("--arch", choices=ARCHS, default="resnet18")
    group.add_argument("--resnet-sizes", type=int, nargs=2, default=[2000, 10_000], metavar=("SMALL", "LARGE"))
    group.add_argument("--resnet-storage", choices=("local", "s3", "both"), default="both")
    # rayline's settings are chosen by resnet_inference.choose_settings; these override them (tuning)
    group.add_argument("--resnet-actors", type=int)
    group.add_argument("--resnet-batch-size", type=int)
    group.add_argument("--resnet-objects-per-task", type=int)
    group.add_argument("--resnet-cpus-per-actor", type=float)
