"""What JPEG draft decoding costs and saves on generated photos (``ImageSpec.draft``).

Decodes the same generated photos (views of scikit-learn's two real photos,
``--large-share`` of them over 2 megapixels) with the ImageNet spec of
``--arch`` twice: with draft decoding (the default) and with full decoding.
Prints the decode time of each, the pixel differences of the model inputs,
and the top-1 agreement of a proxy classifier on a ``weights=None``
network's features (nothing can be downloaded here; see ``_Top1Proxy``; the
number of distinct top-1 classes is printed to show the predictions are
spread). Ends with one JSON line.

    .venv/bin/python bench/preprocessing.py [--photos 300] [--large-share 0.5] [--arch resnet18]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ray_workloads.images import decode_image, decode_rgb
from ray_workloads.models import build_model, imagenet_image_spec
from rayline.seed import jpeg_bytes, photo_objects
from rayline.specs import ImageSpec, ModelSpec


def _decode_all(photos: list[bytes], spec: ImageSpec) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    arrays = np.stack([decode_image(data, spec) for data in photos])
    return arrays, time.perf_counter() - started


def _features(model: torch.nn.Module, inputs: np.ndarray, batch: int = 32) -> np.ndarray:
    out = []
    with torch.no_grad():
        for start in range(0, len(inputs), batch):
            out.append(model(torch.from_numpy(inputs[start : start + batch])).numpy())
    return np.concatenate(out)


class _Top1Proxy:
    """A classifier whose top-1 moves when the features move: standardised features, a random head.

    A ``weights=None`` network's own head gives one or two classes for every
    photo, so agreement would prove nothing. Its penultimate features still
    depend on the pixels; standardised over the photos (statistics of the
    full decodes) and projected on 1,000 random directions they give top-1
    classes spread over hundreds of classes, which a pixel difference can flip.
    """

    def __init__(self, reference: np.ndarray, seed: int) -> None:
        self.mean, self.std = reference.mean(axis=0), reference.std(axis=0) + 1e-6
        self.head = np.random.default_rng(seed).standard_normal((reference.shape[1], 1000))

    def __call__(self, features: np.ndarray) -> np.ndarray:
        return np.asarray((((features - self.mean) / self.std) @ self.head).argmax(axis=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=300)
    parser.add_argument("--large-share", type=float, default=0.5, help="Share of photos over 2 megapixels.")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    photos = [data for _, data in photo_objects(args.photos, np.random.default_rng(args.seed), args.large_share)]
    drafted_spec = imagenet_image_spec(args.arch)
    full_spec = drafted_spec.model_copy(update={"draft": False})
    full, full_s = _decode_all(photos, full_spec)
    drafted, drafted_s = _decode_all(photos, drafted_spec)
    diff = np.abs(full - drafted)
    torch.manual_seed(args.seed)
    model = build_model(ModelSpec(arch=args.arch, num_classes=1000)).eval()
    model.fc = torch.nn.Identity()  # the penultimate features (ResNets)
    features_full, features_drafted = _features(model, full), _features(model, drafted)
    top1 = _Top1Proxy(features_full, args.seed)
    top_full, top_drafted = top1(features_full), top1(features_drafted)
    agreement = float((top_full == top_drafted).mean())
    # the proxy's sensitivity for scale: the same photos saved once more as JPEG at quality 90
    reencoded, _ = _decode_all([jpeg_bytes(decode_rgb(data, full_spec), 90) for data in photos], full_spec)
    agreement_reencoded = float((top_full == top1(_features(model, reencoded))).mean())
    drafted_rows = diff.reshape(len(photos), -1).max(axis=1) > 0  # the photos draft decoding changed
    agreement_drafted = float((top_full == top_drafted)[drafted_rows].mean()) if drafted_rows.any() else 1.0
    print(f"{len(photos)} photos ({args.large_share:.0%} over 2 MP), {args.arch} ImageNet spec {full_spec.describe()}")
    print(f"decode, full:   {full_s:7.2f} s  ({len(photos) / full_s:6.1f} photos/s)")
    print(f"decode, draft:  {drafted_s:7.2f} s  ({len(photos) / drafted_s:6.1f} photos/s)  ×{full_s / drafted_s:.2f}")
    print(f"model input |full - draft|: max {diff.max():.3f}, mean {diff.mean():.4f} (normalised units)")
    print(
        f"top-1 agreement, proxy head on weights=None {args.arch} features: {agreement:.1%} "
        f"({len(set(top_full))} distinct classes); {agreement_drafted:.1%} of the "
        f"{int(drafted_rows.sum())} photos draft decoding changed; saving each photo once more as "
        f"JPEG q90 agrees {agreement_reencoded:.1%}"
    )
    print(
        json.dumps(
            {
                "photos": len(photos),
                "large_share": args.large_share,
                "draft_speedup": round(full_s / drafted_s, 3),
                "draft_max_abs_diff": round(float(diff.max()), 4),
                "draft_mean_abs_diff": round(float(diff.mean()), 5),
                "draft_top1_agreement": round(agreement, 4),
                "draft_top1_agreement_changed": round(agreement_drafted, 4),
                "draft_changed_photos": int(drafted_rows.sum()),
                "jpeg_q90_resave_top1_agreement": round(agreement_reencoded, 4),
                "distinct_top1": len(set(top_full)),
            }
        )
    )


if __name__ == "__main__":
    main()
