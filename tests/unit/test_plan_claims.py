"""One actor measures a version's plan while the others wait for it; a claim its actor abandoned is taken over."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rayline.hardware import detect
from rayline.ray_workloads.execution import cache
from rayline.ray_workloads.execution.cache import claim_uri, libraries, plan_for, plan_key, plan_uri, store_plan
from rayline.ray_workloads.execution.interface import LoadedModel
from rayline.ray_workloads.execution.plan import REFERENCE, PlanChoice, PlanPolicy, torch_run
from rayline.specs import ModelSpec

pytestmark = pytest.mark.unit

PROBE = np.zeros((4, 3, 8, 8), np.float32)
POLICY = PlanPolicy(precision="fp32")


def _loaded() -> LoadedModel:
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    return LoadedModel(ModelSpec(arch="resnet18", num_classes=4), None, torch_run(module, REFERENCE), module)


def _claim_path(version: str) -> Path:
    return Path(claim_uri(version, plan_key(detect(), POLICY, libraries())))


def _hold_claim(version: str, state: str = "measuring", age_s: float = 0.0) -> None:
    path = _claim_path(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"state": state, "host": "elsewhere", "pid": 1, "at": time.time() - age_s}))


def _measured_elsewhere(tmp_path: Path) -> PlanChoice:
    return plan_for(_loaded(), str(tmp_path / "other"), PROBE, POLICY)


@pytest.fixture
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "CLAIM_POLL_S", 0.05)


def _never_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def measuring(*_: object) -> PlanChoice:
        raise AssertionError("an actor measured while another held the claim")

    monkeypatch.setattr(LoadedModel, "choose_plan", measuring)


def test_an_actor_waits_for_the_claimants_plan_instead_of_measuring_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quick_polls: None
) -> None:
    version = str(tmp_path / "v1")
    _hold_claim(version)
    choice = _measured_elsewhere(tmp_path)
    _never_measured(monkeypatch)
    uri = plan_uri(version, plan_key(detect(), POLICY, libraries()))
    storing = threading.Timer(0.5, store_plan, (uri, choice, {}))
    started = time.monotonic()  # before the timer starts: a thread descheduled between the two measured under 0.5 s
    storing.start()
    adopted = plan_for(_loaded(), version, PROBE, POLICY)
    storing.join()
    assert adopted.reason == choice.reason and time.monotonic() - started >= 0.5


def test_a_claim_released_without_a_plan_sends_the_waiter_to_measure(tmp_path: Path, quick_polls: None) -> None:
    version = str(tmp_path / "v1")
    _hold_claim(version)
    threading.Timer(0.3, _hold_claim, (version, "released")).start()
    assert plan_for(_loaded(), version, PROBE, POLICY).reason == "fp32 eager: pinned"


def test_an_abandoned_claim_is_taken_over_and_released_once_the_plan_is_stored(tmp_path: Path) -> None:
    version = str(tmp_path / "v1")
    _hold_claim(version, age_s=cache.MEASURE_WAIT_S + 1)
    started = time.monotonic()
    assert plan_for(_loaded(), version, PROBE, POLICY).reason == "fp32 eager: pinned"
    assert time.monotonic() - started < 5  # measured at once, no wait for the dead claimant
    claim = json.loads(_claim_path(version).read_text())
    assert claim["state"] == "released" and claim["host"] != "elsewhere"
    assert Path(plan_uri(version, plan_key(detect(), POLICY, libraries()))).exists()


def test_concurrent_actors_measure_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quick_polls: None) -> None:
    version, measured = str(tmp_path / "v1"), []
    original = LoadedModel.choose_plan

    def counted(self: LoadedModel, *args: object) -> PlanChoice:
        measured.append(1)
        time.sleep(0.3)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LoadedModel, "choose_plan", counted)
    results: list[str] = []
    actors = [
        threading.Thread(target=lambda: results.append(plan_for(_loaded(), version, PROBE, POLICY).reason))
        for _ in range(4)
    ]
    for actor in actors:
        actor.start()
    for actor in actors:
        actor.join()
    assert measured == [1] and results == ["fp32 eager: pinned"] * 4
