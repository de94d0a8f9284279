"""What reduced-scale JPEG decoding (``ImageSpec.draft``, the default) costs and saves, on generated photos.

Decodes the same photos (``--photos`` views of the two real photos, ``--large-share`` over 2 MP, and
``--camera`` camera-sized ones) with the ImageNet spec of ``--arch`` at a reduced DCT scale and fully.
Prints a photo's decode cost at 1, 3 and 12 MP, the model inputs' difference against
``DRAFT_MAX_MEAN_ABS_DIFF``, and a proxy classifier's top-1 agreement (see ``_Top1Proxy``); what each
figure is: bench/README.md. Ends with one JSON line.

    .venv/bin/python bench/preprocessing.py [--photos 300] [--camera 60] [--arch resnet18]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from rayline.ray_workloads.architectures.build import build_model, imagenet_image_spec
from rayline.ray_workloads.data.images import DRAFT_MAX_MEAN_ABS_DIFF, decode_image, decode_rgb
from rayline.seed import CAMERA_MEGAPIXELS, camera_photos, jpeg_bytes, photo_objects
from rayline.specs import ImageSpec, ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.support, run as a script

from bench.support.results import emit  # noqa: E402
from bench.support.timing import run_seconds  # noqa: E402


def _decode_all(photos: list[bytes], spec: ImageSpec) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    arrays = np.stack([decode_image(data, spec) for data in photos])
    return arrays, time.perf_counter() - started


def _photo_ms(photos: list[bytes], spec: ImageSpec, repeats: int) -> float:
    """Milliseconds to turn one photo into model input: the median over photos of each one's median run."""
    per_photo = [statistics.median(run_seconds(partial(decode_image, data, spec), repeats)) for data in photos]
    return 1000 * statistics.median(per_photo)


def _features(model: torch.nn.Module, inputs: np.ndarray, batch: int = 32) -> np.ndarray:
    out = []
    with torch.no_grad():
        for start in range(0, len(inputs), batch):
            out.append(model(torch.from_numpy(inputs[start : start + batch])).numpy())
    return np.concatenate(out)


class _Top1Proxy:
    """A classifier whose top-1 moves when the features move: standardised features, a random head.

    A ``weights=None`` network's own head gives one or two classes for every photo, so agreement with it
    would prove nothing; its penultimate features, standardised (statistics of the full decodes) and
    projected on 1,000 random directions, spread the top-1 over hundreds of classes.
    """

    def __init__(self, reference: np.ndarray, seed: int) -> None:
        self.mean, self.std = reference.mean(axis=0), reference.std(axis=0) + 1e-6
        self.head = np.random.default_rng(seed).standard_normal((reference.shape[1], 1000))

    def __call__(self, features: np.ndarray) -> np.ndarray:
        return np.asarray((((features - self.mean) / self.std) @ self.head).argmax(axis=1))


def _camera_set(count: int, seed: int) -> tuple[list[bytes], list[float]]:
    """``count`` camera photos (1, 3, 12 MP in turn) and the megapixels of each."""
    keys, photos = zip(*camera_photos(count, np.random.default_rng(seed + 1)), strict=True)
    sizes = [float(key.split("camera-")[1].split("mp-")[0]) for key in keys]
    return list(photos), sizes


def _decode_costs(
    photos: list[bytes], sizes: list[float], specs: tuple[ImageSpec, ImageSpec], timed: int, repeats: int
) -> dict[str, float]:
    """Per size: ms per photo with full and reduced-scale decoding, and the speed-up."""
    full, drafted = specs
    costs: dict[str, float] = {}
    for megapixels in CAMERA_MEGAPIXELS:
        sample = [data for data, size in zip(photos, sizes, strict=True) if size == megapixels][:timed]
        full_ms, draft_ms = _photo_ms(sample, full, repeats), _photo_ms(sample, drafted, repeats)
        costs |= {
            f"decode_ms_full_{megapixels}mp": round(full_ms, 2),
            f"decode_ms_draft_{megapixels}mp": round(draft_ms, 2),
            f"decode_speedup_{megapixels}mp": round(full_ms / draft_ms, 2),
        }
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=300, help="Views of the two real photos.")
    parser.add_argument("--large-share", type=float, default=0.5, help="Share of views over 2 megapixels.")
    parser.add_argument("--camera", type=int, default=60, help="Camera-sized photos, 1, 3 and 12 MP in turn.")
    parser.add_argument("--timed", type=int, default=5, help="Photos of each size timed one by one.")
    parser.add_argument("--repeats", type=int, default=5, help="Runs of each timed photo (the median counts).")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    views = [data for _, data in photo_objects(args.photos, np.random.default_rng(args.seed), args.large_share)]
    camera, sizes = _camera_set(args.camera, args.seed)
    photos = views + camera
    drafted_spec = imagenet_image_spec(args.arch)
    full_spec = drafted_spec.model_copy(update={"draft": False})
    costs = _decode_costs(camera, sizes, (full_spec, drafted_spec), args.timed, args.repeats)

    full, full_s = _decode_all(photos, full_spec)
    drafted, drafted_s = _decode_all(photos, drafted_spec)
    diff = np.abs(full - drafted)
    photo_diff = diff.reshape(len(photos), -1).mean(axis=1)  # the quantity DRAFT_MAX_MEAN_ABS_DIFF bounds
    is_camera = np.arange(len(photos)) >= len(views)
    size_of = np.asarray([0.0] * len(views) + sizes)
    torch.manual_seed(args.seed)
    model = build_model(ModelSpec(arch=args.arch, num_classes=1000)).eval()
    model.fc = torch.nn.Identity()  # the penultimate features (ResNets)
    features_full, features_drafted = _features(model, full), _features(model, drafted)
    top1 = _Top1Proxy(features_full, args.seed)
    top_full, top_drafted = top1(features_full), top1(features_drafted)
    agrees = top_full == top_drafted
    # the proxy's sensitivity for scale: the same photos saved once more as JPEG at quality 90
    reencoded, _ = _decode_all([jpeg_bytes(decode_rgb(data, full_spec), 90) for data in photos], full_spec)
    agreement_reencoded = float((top_full == top1(_features(model, reencoded))).mean())
    drafted_rows = diff.reshape(len(photos), -1).max(axis=1) > 0  # the photos reduced-scale decoding changed

    print(f"{len(views)} views ({args.large_share:.0%} over 2 MP) + {len(camera)} camera photos (1, 3, 12 MP)")
    print(f"{args.arch} ImageNet spec {full_spec.describe()}")
    print("a photo's decode cost (decode + transform to the model input, median ms):")
    print("   size      full   reduced   speed-up   mean |diff|   max photo mean |diff|")
    per_size: dict[str, float] = {}
    for megapixels in CAMERA_MEGAPIXELS:
        rows = size_of == megapixels
        mean_diff, worst = float(photo_diff[rows].mean()), float(photo_diff[rows].max())
        per_size[f"draft_mean_abs_diff_{megapixels}mp"] = round(mean_diff, 5)
        print(
            f"  {megapixels:>2} MP {costs[f'decode_ms_full_{megapixels}mp']:8.1f} "
            f"{costs[f'decode_ms_draft_{megapixels}mp']:9.1f}   ×{costs[f'decode_speedup_{megapixels}mp']:5.2f}"
            f"      {mean_diff:.4f}        {worst:.4f}"
        )
    print(f"all {len(photos)} photos, full: {full_s:6.2f} s, reduced: {drafted_s:6.2f} s (×{full_s / drafted_s:.2f})")
    print(
        f"model input |full - reduced|: max {diff.max():.3f}, mean {diff.mean():.4f}; worst photo mean "
        f"{photo_diff.max():.4f} (bound DRAFT_MAX_MEAN_ABS_DIFF {DRAFT_MAX_MEAN_ABS_DIFF})"
    )
    print(
        f"top-1 agreement, proxy head on weights=None {args.arch} features: {agrees.mean():.1%} "
        f"({len(set(top_full))} distinct classes), camera photos {agrees[is_camera].mean():.1%}; "
        f"{agrees[drafted_rows].mean():.1%} of the {int(drafted_rows.sum())} photos reduced-scale decoding "
        f"changed; saving each photo once more as JPEG q90 agrees {agreement_reencoded:.1%}"
    )
    emit(
        "preprocessing",
        {
            "photos": len(photos),
            "camera_photos": len(camera),
            "large_share": args.large_share,
            **costs,
            "draft_speedup": round(full_s / drafted_s, 3),
            "draft_max_abs_diff": round(float(diff.max()), 4),
            "draft_mean_abs_diff": round(float(diff.mean()), 5),
            **per_size,
            "draft_max_photo_mean_abs_diff": round(float(photo_diff.max()), 5),
            "draft_mean_abs_diff_bound": DRAFT_MAX_MEAN_ABS_DIFF,
            "draft_top1_agreement": round(float(agrees.mean()), 4),
            "draft_top1_agreement_camera": round(float(agrees[is_camera].mean()), 4),
            "draft_top1_agreement_changed": round(float(agrees[drafted_rows].mean()), 4),
            "draft_changed_photos": int(drafted_rows.sum()),
            "jpeg_q90_resave_top1_agreement": round(agreement_reencoded, 4),
            "distinct_top1": len(set(top_full)),
        },
    )


if __name__ == "__main__":
    main()
