"""A plan's decode: chosen by the model's answers on photos as bytes, cached with the plan, its probe reused.

The photos are camera-sized JPEGs (1 MP, so that a 64 px crop decodes three ways: in full, reduced to 2x and
to 1x the needed side). Two stand-in models bracket what a decode can do to answers: one reads each channel's
mean (which a reduced decode barely moves), one whose answer hangs on every pixel (any change flips it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rayline.hardware import detect
from rayline.ray_workloads.data.images import decode_image, reducible
from rayline.ray_workloads.execution import cache, decoding
from rayline.ray_workloads.execution.cache import libraries, plan_for, plan_key, plan_uri
from rayline.ray_workloads.execution.decoding import choose_decode, probe_photos
from rayline.ray_workloads.execution.interface import LoadedModel
from rayline.ray_workloads.execution.plan import REFERENCE, PlanChoice, PlanPolicy, torch_run
from rayline.seed import camera_photo
from rayline.specs import ImageSpec, ModelSpec

pytestmark = pytest.mark.unit

SPEC = ImageSpec(mode="resize_crop", resize=73, crop=64, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
POLICY = PlanPolicy(precision="fp32")


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    rng = np.random.default_rng(3)
    return [camera_photo(1, rng) for _ in range(6)]


def channel_means(batch: np.ndarray) -> np.ndarray:
    """Scores a reduced decode cannot change: which channel is brightest, by a wide margin on these photos."""
    return 20 * batch.mean(axis=(2, 3))  # type: ignore[no-any-return]


def every_pixel(batch: np.ndarray) -> np.ndarray:
    """Scores any change of any pixel flips: what a decode must never be allowed to change silently."""
    total = batch.astype(np.float64).sum(axis=(1, 2, 3)) * 1e4
    return np.stack([np.sin(total), np.cos(total)], axis=1)


def test_only_jpegs_a_decode_can_change_judge_one(photos: list[bytes]) -> None:
    assert all(reducible(p, SPEC) for p in photos)  # a 1 MP photo for a 73 px side; not under twice the side
    assert not reducible(photos[0], SPEC.model_copy(update={"draft": False}))  # --full-decode: never judged
    assert not reducible(photos[0], SPEC.model_copy(update={"resize": 600, "crop": 512}))
    assert not reducible(b"not an image", SPEC) and not reducible(None, SPEC)
    assert probe_photos([None, b"x", *photos], SPEC) == photos


def test_the_fastest_decode_whose_answers_agree_with_full_decoding_is_chosen(photos: list[bytes]) -> None:
    outcome = choose_decode(photos, SPEC, channel_means, channel_means, POLICY)
    judged = outcome.judged
    assert judged.decode == "1x" and outcome.keeps_precision, judged.reason
    assert judged.gate is not None and judged.gate.agreement == 1.0 and judged.gate.images == len(photos)
    assert judged.ms_per_photo["1x"] > 0 and judged.ms_per_photo["full"] > 0, "both timed (for the record)"
    assert "top-1 agreement 1.0000 with full decoding in fp32 on 6 photos" in judged.reason
    # the chosen pair's outputs, on the photos as it decodes them: what the night reuses
    expected = np.stack([decode_image(p, SPEC, "1x") for p in photos])
    np.testing.assert_array_equal(outcome.images, expected)
    np.testing.assert_array_equal(outcome.logits, channel_means(expected))


def test_a_decode_that_changes_answers_is_refused_and_full_decoding_runs(photos: list[bytes]) -> None:
    outcome = choose_decode(photos, SPEC, every_pixel, every_pixel, POLICY)
    assert outcome.judged.decode == "full" and outcome.keeps_precision
    assert "1x refused: top-1 agreement" in outcome.judged.reason and "2x refused" in outcome.judged.reason


def test_a_decode_and_a_precision_are_judged_together(photos: list[bytes]) -> None:
    """A precision that passes alone may not pass with a reduced decode: the pair is what a night runs."""

    def narrow(batch: np.ndarray) -> np.ndarray:  # a precision whose top class hangs on every pixel
        shifts = (batch.astype(np.float64).sum(axis=(1, 2, 3)) * 1e4).astype(np.int64) % 3
        return np.stack([np.roll(row, shift) for row, shift in zip(channel_means(batch), shifts, strict=True)])

    outcome = choose_decode(photos, SPEC, narrow, channel_means, POLICY)
    # no decode passes in the narrow precision, 1x passes in fp32: fp32 runs, with the faster decode
    assert outcome.judged.decode == "1x" and not outcome.keeps_precision
    assert "1x refused" in outcome.judged.reason and "full refused" in outcome.judged.reason


def _loaded(logits: decoding.Logits | None = None) -> LoadedModel:
    module = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 3)).eval()
    with torch.no_grad():
        module[2].weight.copy_(20 * torch.eye(3))
        module[2].bias.zero_()
    run = logits or torch_run(module, REFERENCE)
    return LoadedModel(ModelSpec(arch="resnet18", num_classes=3), SPEC, run, module)


def test_a_plans_probe_outputs_are_not_predicted_again() -> None:
    calls: list[int] = []

    def counted(batch: np.ndarray) -> np.ndarray:
        calls.append(len(batch))
        return channel_means(batch)

    model = _loaded(counted)
    images = np.random.default_rng(0).normal(size=(5, 3, 8, 8)).astype(np.float32)
    model.remember(images[[1, 3]], channel_means(images[[1, 3]]))
    np.testing.assert_allclose(model.logits(images), channel_means(images), rtol=1e-6)
    assert calls == [3]  # the two remembered images were not predicted
    model.remember(images[:2], channel_means(images[:2]))
    model.logits(images[:2])
    model.forget()
    model.logits(images[:2])
    assert calls == [3, 2] and model.use.batches == 3


def test_a_decode_is_judged_once_per_version_and_machine_then_adopted(
    photos: list[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = str(tmp_path / "models" / "m" / "v1")
    probe = np.stack([decode_image(p, SPEC) for p in photos])
    # measured where the version was made: on decoded samples, its decode not judged
    ahead = plan_for(_loaded(), version, probe, POLICY)
    uri = plan_uri(version, plan_key(detect(), POLICY, libraries()))
    assert ahead.decode is None and "decode" not in json.loads(Path(uri).read_text())
    # the first night judges it on its photos and adds it to the record
    first = _loaded()
    night = plan_for(first, version, probe, POLICY, photos)
    assert night.decode is not None and night.decode.decode == "1x" and night.name.endswith("+decode-1x")
    stored = json.loads(Path(uri).read_text())
    assert stored["decode"] == "1x" and stored["plan"] == night.name and stored["decode_photos"] == len(photos)
    assert stored["reason"] == ahead.reason and stored["libraries"] == libraries()
    assert PlanChoice.from_record(stored).decode == night.decode
    # the next actor adopts it without judging
    monkeypatch.setattr(LoadedModel, "judge_decode", lambda *_: pytest.fail("a judged decode was judged again"))
    again = _loaded()
    adopted = plan_for(again, version, probe, POLICY, photos)
    assert adopted.decode == night.decode and again.plan is not None and again.plan.name == night.name


def test_an_actor_runs_the_unjudged_decode_while_another_judges_it_then_adopts_the_judged_one(
    photos: list[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = str(tmp_path / "models" / "m" / "v1")
    probe = np.stack([decode_image(p, SPEC) for p in photos])
    plan_for(_loaded(), version, probe, POLICY)  # measured ahead, its decode not judged
    key = plan_key(detect(), POLICY, libraries())
    judging = cache._claim(cache.claim_uri(version, key))  # the actor judging the decode holds the claim
    assert judging is not None
    monkeypatch.setattr(cache, "_await_plan", lambda *_: pytest.fail("an actor waited for a decode"))
    waiter = _loaded()
    meanwhile = plan_for(waiter, version, probe, POLICY, photos)
    assert meanwhile.decode is None and meanwhile.decode_pending and waiter.plan == meanwhile
    assert "+decode" not in meanwhile.name, "its rows name no judged decode"
    # the claimant's judgement lands (released, then judged by whoever claims next: here, another actor)
    cache._release(cache.claim_uri(version, key), judging)
    judged = plan_for(_loaded(), version, probe, POLICY, photos)
    assert judged.decode is not None and not judged.decode_pending
    # the waiter's next chunk adopts it, without judging
    monkeypatch.setattr(LoadedModel, "judge_decode", lambda *_: pytest.fail("a judged decode was judged again"))
    monkeypatch.setattr(LoadedModel, "adopt", lambda *_: pytest.fail("the running plan's model was loaded again"))
    adopted = plan_for(waiter, version, probe, POLICY, photos)
    assert adopted.decode == judged.decode and not adopted.decode_pending and waiter.plan == adopted
