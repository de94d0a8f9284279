"""A version's JPEG decode, chosen by the model's answers rather than by a pixel rule.

Reducing a camera photo at decode time (libjpeg's DCT scaling) is several times faster than decoding it in
full, and it changes pixels; whether it changes answers depends on the model. So a plan takes the fastest
decode whose answers, in the plan's precision, agree with full decoding in fp32 (what a plain loop does) on
the night's first photos as bytes: a version's stored samples are already decoded and cannot judge a decode.
Each pair of a decode and a precision is judged together, as a night runs them, by the precision's own gate
(:meth:`Gate.refusal`): on n photos, a decode that changes the top class of a share d of the photos it can
change passes with probability (1−d)^n (docs/execution-plans.md). Only photos a decode can change count:
JPEGs at least twice the needed side. Pillow is the decoder: simplejpeg and OpenCV's reduced decodes were
measured within 5 % of it on camera photos (bench/README.md), so they do not pay for a dependency.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from rayline.ray_workloads.data.images import Decode, decode_image, reducible
from rayline.ray_workloads.execution.plan import DecodeJudged, Logits, PlanPolicy, gate
from rayline.specs import ImageSpec

# photos a decode is judged on: a night's first reducible ones (ResNet-50 fp32 on one thread: ~0.1 s each,
# predicted twice, once as the reference and once as the candidate whose outputs the night then reuses)
DECODE_PROBE_PHOTOS = 16
FASTEST_FIRST: tuple[Decode, ...] = ("1x", "2x")


@dataclass(frozen=True)
class DecodeOutcome:
    """The decode chosen, whether the plan's precision survived it, and the chosen pair's probe outputs."""

    judged: DecodeJudged
    keeps_precision: bool  # False: no decode passed in the plan's precision, fp32 eager runs instead
    images: np.ndarray  # the probe photos as the chosen pair decodes them
    logits: np.ndarray  # the chosen pair's outputs on them: the night reuses them rather than predicting again


def probe_photos(photos: list[bytes | None], spec: ImageSpec) -> list[bytes]:
    """The photos that can judge a decode: the first :data:`DECODE_PROBE_PHOTOS` a decode can change."""
    found = (p for p in photos if p is not None and reducible(p, spec))  # headers read until enough are found
    return list(itertools.islice(found, DECODE_PROBE_PHOTOS))


def choose_decode(
    photos: list[bytes], spec: ImageSpec, plan_run: Logits, reference_run: Logits, policy: PlanPolicy
) -> DecodeOutcome:
    """The fastest (decode, precision) pair that passes the gate against (full decode, fp32) on ``photos``.

    Pairs are tried fastest first: 1x, 2x, then full, in the plan's precision (``plan_run``), then 1x and 2x
    in fp32 (``reference_run``); full decoding in fp32 is the reference itself.
    """
    decoded: dict[str, np.ndarray] = {}
    ms: dict[str, float] = {}

    def images(decode: Decode) -> np.ndarray:  # each decode made once, and only when its pair is judged
        if decode not in decoded:
            decoded[decode], ms[decode] = _decoded(photos, spec, decode)
        return decoded[decode]

    reference = reference_run(images("full"))
    pairs: list[tuple[Decode, bool]] = [(d, True) for d in (*FASTEST_FIRST, "full")]
    if plan_run is not reference_run:
        pairs += [(d, False) for d in FASTEST_FIRST]
    refusals: list[str] = []
    for decode, in_plan in pairs:
        logits = (plan_run if in_plan else reference_run)(images(decode))
        result = gate(reference, logits)
        refusal = result.refusal(policy)
        if refusal is None:
            reason = _chosen_reason(decode, result.agreement, len(photos), ms, refusals)
            return DecodeOutcome(DecodeJudged(decode, reason, result, ms), in_plan, decoded[decode], logits)
        refusals.append(f"{decode}{'' if in_plan else ' in fp32'} refused: {refusal}")
    judged = DecodeJudged("full", "full decoding: " + "; ".join(refusals), gate(reference, reference), ms)
    return DecodeOutcome(judged, False, decoded["full"], reference)


def _decoded(photos: list[bytes], spec: ImageSpec, decode: Decode) -> tuple[np.ndarray, float]:
    """The photos decoded one way, and the milliseconds a photo took (decode and transform)."""
    started = time.perf_counter()
    images = np.stack([decode_image(photo, spec, decode) for photo in photos])
    return images, round(1000 * (time.perf_counter() - started) / len(photos), 2)


def _chosen_reason(decode: Decode, agreement: float, photos: int, ms: dict[str, float], refusals: list[str]) -> str:
    reason = (
        f"decode {decode}: {ms[decode]:.1f} ms a photo against {ms['full']:.1f} in full, top-1 agreement "
        f"{agreement:.4f} with full decoding in fp32 on {photos} photos"
    )
    return reason + "".join(f" ({refusal})" for refusal in refusals)
