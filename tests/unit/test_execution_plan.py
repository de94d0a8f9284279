"""The execution plan: which candidates a machine gets, how the choice is measured and gated, and its cache.

The machines that run these tests vary (AVX-512 with or without BF16, with
or without AMX), so nothing here depends on the CPU underneath: the choice
logic runs on hand-built :class:`Hardware` and on fake plans whose speed is
a sleep, and the gate runs on a real ResNet-18 trained on the digits for a
few seconds (random weights' logits are nearly tied and say nothing about
reduced precision). bf16 runs on any CPU under autocast, emulated where it
is not native, so the gate's two outcomes are tested everywhere.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from rayline.hardware import Hardware, detect, parse_cpuinfo
from rayline.ray_workloads.execution.cache import libraries, plan_for, plan_key, plan_uri
from rayline.ray_workloads.execution.interface import LoadedModel
from rayline.ray_workloads.execution.plan import (
    PROBE_IMAGES,
    REFERENCE,
    Backend,
    Gate,
    Logits,
    Plan,
    PlanChoice,
    PlanPolicy,
    candidates,
    choose,
    gate,
    plans_text,
    torch_run,
)
from rayline.specs import ModelSpec
from rayline.testing.trained_models import digits_resnet18

pytestmark = pytest.mark.unit

PLAIN = Hardware("Plain CPU", ("avx2", "avx512f"))
BF16 = Hardware("Xeon with AVX-512-BF16", ("avx2", "avx512f", "avx512_bf16"))
AMX = Hardware("Xeon with AMX", ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))
GPU = Hardware("Host CPU", ("avx2",), gpu="A GPU", gpu_bf16=True)

PROBE = np.zeros((4, 3, 8, 8), np.float32)
CLASSES = 5


def test_cpuinfo_gives_the_model_and_only_the_flags_that_decide_a_plan() -> None:
    text = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
        "processor\t: 1\nmodel name\t: something else\nflags\t\t: fpu\n"
    )
    assert parse_cpuinfo(text) == (
        "Intel(R) Xeon(R) Platinum 8480+",
        ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"),
    )
    assert parse_cpuinfo("") == ("", ())
    here = detect(with_gpu=False)
    assert here.cpu_model and Hardware.from_record(here.as_record()) == here


def test_bf16_is_a_candidate_only_where_the_hardware_computes_it() -> None:
    auto = PlanPolicy()
    assert candidates(PLAIN, "cpu", auto) == []
    assert candidates(BF16, "cpu", auto) == [Plan(precision="bf16")]
    assert candidates(AMX, "cpu", auto) == [Plan(precision="bf16")] and AMX.amx and not BF16.amx
    assert candidates(GPU, "cuda", auto) == [Plan(precision="fp16"), Plan(precision="bf16")]
    assert candidates(Hardware("c", (), gpu="old GPU"), "cuda", auto) == [Plan(precision="fp16")]
    # a pin is measured against fp32 wherever it is asked for; fp32 pinned is the reference alone
    assert candidates(PLAIN, "cpu", PlanPolicy(precision="bf16")) == [Plan(precision="bf16")]
    assert candidates(AMX, "cpu", PlanPolicy(precision="fp32")) == []


def _logits_of(top: int) -> np.ndarray:
    logits = np.zeros((len(PROBE), CLASSES), np.float32)
    logits[:, top] = 4.0
    return logits


def _fake_runs(seconds: dict[str, float], answers: dict[str, np.ndarray] | None = None) -> Callable[[Plan], Logits]:
    """Plans that take ``seconds[plan.name]`` a call and answer ``answers[plan.name]`` (the reference's by default)."""

    def make(plan: Plan) -> Logits:
        def run(batch: np.ndarray) -> np.ndarray:
            if plan.name not in seconds:
                raise RuntimeError(f"{plan.name} is not supported here")
            time.sleep(seconds[plan.name])
            return (answers or {}).get(plan.name, _logits_of(0))

        return run

    return make


FP32, BF16_PLAN, FP16_PLAN = REFERENCE.name, Plan(precision="bf16").name, Plan(precision="fp16").name


def test_a_faster_plan_that_agrees_is_chosen_and_says_why() -> None:
    choice = choose(_fake_runs({FP32: 0.02, BF16_PLAN: 0.002}), PROBE, BF16, "cpu", PlanPolicy())
    assert choice.plan == Plan(precision="bf16")
    assert choice.gate == Gate(1.0, 0.0, len(PROBE))
    assert choice.speeds[BF16_PLAN] > choice.speeds[FP32], "chosen for being faster (by how much: the sleeps)"
    assert choice.reason.startswith("eager/bf16/channels-last: ") and "top-1 agreement 1.0000" in choice.reason


def test_a_plan_no_faster_than_fp32_is_not_worth_its_different_answers() -> None:
    choice = choose(_fake_runs({FP32: 0.002, BF16_PLAN: 0.02}), PROBE, BF16, "cpu", PlanPolicy())
    assert choice.plan == REFERENCE
    assert "eager/bf16/channels-last refused:" in choice.reason and "is not faster than fp32's" in choice.reason
    # pinned, it is used however slow, since the user asked for it and it passed the gate
    pinned = choose(_fake_runs({FP32: 0.002, BF16_PLAN: 0.02}), PROBE, PLAIN, "cpu", PlanPolicy(precision="bf16"))
    assert pinned.plan == Plan(precision="bf16")


def test_a_plan_that_cannot_run_falls_back_to_fp32_naming_the_error() -> None:
    choice = choose(_fake_runs({FP32: 0.001}), PROBE, BF16, "cpu", PlanPolicy())
    assert choice.plan == REFERENCE
    assert (
        choice.reason
        == "fp32 eager: eager/bf16/channels-last failed: RuntimeError: eager/bf16/channels-last is not supported here"
    )


def test_a_fast_plan_that_changes_the_answers_is_refused_by_the_gate() -> None:
    wrong = _fake_runs({FP32: 0.02, BF16_PLAN: 0.001}, {BF16_PLAN: _logits_of(1)})
    choice = choose(wrong, PROBE, BF16, "cpu", PlanPolicy())
    assert choice.plan == REFERENCE
    assert "top-1 agreement 0.0000 < 0.995 on 4 probe images" in choice.reason
    assert gate(_logits_of(0), _logits_of(1)) == Gate(0.0, pytest.approx(0.9147, abs=1e-4), len(PROBE))
    assert (
        Gate(0.999, 0.2, 16).refusal(PlanPolicy())
        == "top-class probability differs by up to 0.2000 > 0.05 on 16 probe images"
    )
    assert Gate(0.999, 0.01, 16).refusal(PlanPolicy(min_agreement=0.99)) is None


def test_off_pinned_fp32_and_no_fast_path_run_the_reference_unmeasured_and_say_so() -> None:
    never = _fake_runs({})  # any plan measured would raise
    off = choose(never, PROBE, AMX, "cpu", PlanPolicy(mode="off"))
    assert (off.plan, off.reason) == (REFERENCE, "fp32 eager: the plan's choice is off")
    pinned = choose(never, PROBE, AMX, "cpu", PlanPolicy(precision="fp32"))
    assert (pinned.plan, pinned.reason) == (REFERENCE, "fp32 eager: pinned")
    plain = choose(never, PROBE, PLAIN, "cpu", PlanPolicy())
    assert plain.plan == REFERENCE and plain.speeds == {}
    assert (
        plain.reason
        == "fp32 eager: no reduced-precision fast path on Plain CPU (avx2, avx512f) (none of AVX-512-BF16, AMX)"
    )


def test_a_choice_round_trips_through_its_record_and_reads_in_one_line() -> None:
    choice = choose(_fake_runs({FP32: 0.01, BF16_PLAN: 0.001}), PROBE, AMX, "cpu", PlanPolicy())
    record = json.loads(json.dumps(choice.record()))
    assert PlanChoice.from_record(record).plan == choice.plan
    assert PlanChoice.from_record(record).gate == choice.gate
    assert record["hardware"]["isa"] == list(AMX.isa) and record["plan"] == "eager/bf16/channels-last"
    text = plans_text({record["plan"]: record})
    assert text.startswith("eager/bf16/channels-last: ") and text.endswith(
        "on Xeon with AMX (avx2, avx512f, avx512_bf16, amx_tile, amx_bf16)"
    )
    assert plans_text({}) == "none recorded"
    with pytest.raises(ValueError, match="not a plan record"):
        PlanChoice.from_record({"plan": "eager/fp32"})


# --- the gate on a trained model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_model() -> tuple[torch.nn.Module, np.ndarray]:
    """A ResNet-18 trained on the digits at 32 px for ~10 s (89 % held out), and its first 16 held-out images."""
    module, held_out, _ = digits_resnet18(side=32, steps=60)
    return module, held_out[:PROBE_IMAGES]


def _loaded(module: torch.nn.Module) -> LoadedModel:
    return LoadedModel(ModelSpec(arch="resnet18", num_classes=10), None, torch_run(module, REFERENCE), module)


def test_bf16_on_a_trained_resnet18_passes_the_gate_and_predicts_the_same_classes(
    digits_model: tuple[torch.nn.Module, np.ndarray],
) -> None:
    module, probe = digits_model
    model = _loaded(module)
    reference = model.probabilities(probe).argmax(axis=1)
    choice = model.choose_plan(probe, PlanPolicy(precision="bf16", backend="eager"), BF16)
    assert choice.plan == Plan(precision="bf16"), choice.reason
    assert choice.gate is not None and choice.gate.agreement == 1.0 and choice.gate.max_prob_diff < 0.05
    assert model.plan is choice
    assert (model.probabilities(probe).argmax(axis=1) == reference).all()


def test_bf16_refused_at_a_strict_bound_falls_back_to_fp32_and_says_why(
    digits_model: tuple[torch.nn.Module, np.ndarray],
) -> None:
    module, probe = digits_model
    model = _loaded(module)
    reference = model.probabilities(probe)
    choice = model.choose_plan(probe, PlanPolicy(precision="bf16", backend="eager", max_prob_diff=1e-7), BF16)
    assert choice.plan == REFERENCE
    assert choice.reason.startswith(
        "fp32 eager: eager/bf16/channels-last refused: top-class probability differs by up to "
    )
    assert choice.reason.endswith("> 1e-07 on 16 probe images")
    np.testing.assert_array_equal(model.probabilities(probe), reference)  # fp32 again, bit for bit


# --- the cache -----------------------------------------------------------------------------------------------


def test_a_plan_is_measured_once_per_version_and_machine_then_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)
    ).eval()
    version = str(tmp_path / "models" / "m" / "v1")
    policy = PlanPolicy(precision="fp32")
    first = plan_for(_loaded(module), version, PROBE, policy)
    uri = plan_uri(version, plan_key(detect(), policy, libraries()))
    stored = json.loads(Path(uri).read_text())
    assert stored["reason"] == first.reason == "fp32 eager: pinned" and stored["libraries"] == libraries()

    def measuring(*_: object) -> PlanChoice:
        raise AssertionError("a cached plan was measured again")

    monkeypatch.setattr(LoadedModel, "choose_plan", measuring)
    again = _loaded(module)
    assert plan_for(again, version, PROBE, policy).reason == first.reason and again.plan is not None
    # another policy is another key; a record that is not a plan is measured again, not trusted
    assert plan_key(detect(), PlanPolicy(), libraries()) != plan_key(detect(), policy, libraries())
    Path(uri).write_text("{not json")
    monkeypatch.undo()
    assert plan_for(_loaded(module), version, PROBE, policy).reason == "fp32 eager: pinned"


def test_serving_takes_its_plan_policy_from_settings() -> None:
    from rayline.ray_workloads.serving.config import config_from_settings

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_SERVE_PLAN", "off")
        env.setenv("RAYLINE_SERVE_PRECISION", "bf16")
        assert config_from_settings().plan == PlanPolicy(mode="off", precision="bf16")


def test_a_plan_is_judged_on_the_versions_own_samples_and_a_nights_first_images(
    local_storage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its samples first, then the night's images; a version without samples gets stand-in photos, said in
    the log. Bad samples are refused at registration, never stored."""
    from rayline.errors import ConfigError
    from rayline.models import registry
    from rayline.ray_workloads.execution.cache import probe_set
    from rayline.specs import squash

    spec, image = ModelSpec(num_classes=3, width=4), squash(32)
    samples = np.random.default_rng(1).standard_normal((5, 3, 32, 32)).astype(np.float32)

    def register(with_samples: np.ndarray | None) -> registry.ModelVersion:
        weights = b"\0"  # never loaded here
        return registry.register("probe", weights, model_spec=spec, image_spec=image, classes=["a", "b", "c"],
                                 metrics={}, code_version="test", samples=with_samples)  # fmt: skip

    version = register(samples)
    assert version.samples_uri is not None and np.array_equal(registry.read_samples(version), samples)
    night = np.ones((4, 3, 32, 32), dtype=np.float32)
    assert np.array_equal(probe_set(version, image), samples)
    assert np.array_equal(probe_set(version, image, night), np.concatenate([samples, night]))
    bare = register(None)
    assert bare.samples_uri is None and np.array_equal(probe_set(bare, image, night), night)
    with caplog.at_level("WARNING"):
        stand_in = probe_set(bare, image)
    assert "probe v2 has no sample images (register-model --samples)" in caplog.text
    assert stand_in.shape == (16, 3, 32, 32) and stand_in.dtype == np.float32
    assert len({view.tobytes() for view in stand_in}) == 16 and float(stand_in.std()) > 0.1
    with pytest.raises(ConfigError, match=r"1 to 32 decoded images of shape \(3, 32, 32\), got \(2, 3, 64, 64\)"):
        register(np.zeros((2, 3, 64, 64), dtype=np.float32))
    assert [v.version for v in registry.list_versions("probe")] == [1, 2]
    assert not Path(local_storage, "models", "probe", "v3").exists(), "refused before a number was claimed"


def test_the_reason_of_a_chosen_plan_names_the_candidates_refused_beside_it() -> None:
    wrong_bf16 = _fake_runs({FP32: 0.02, BF16_PLAN: 0.001, FP16_PLAN: 0.004}, {BF16_PLAN: _logits_of(1)})
    choice = choose(wrong_bf16, PROBE, GPU, "cuda", PlanPolicy())
    assert choice.plan == Plan(precision="fp16")
    assert "(eager/bf16/channels-last refused: top-1 agreement 0.0000 < 0.995 on 4 probe images)" in choice.reason


# --- OpenVINO, an optional backend ---------------------------------------------------------------------------


def test_openvino_is_a_cpu_candidate_beside_eager_where_bf16_pays_or_where_pinned() -> None:
    both: tuple[Backend, ...] = ("eager", "openvino")
    assert candidates(BF16, "cpu", PlanPolicy(), both) == [Plan(precision="bf16"), Plan("openvino", "bf16", False)]
    assert candidates(PLAIN, "cpu", PlanPolicy(), both) == []  # no fast path: nothing changes
    assert candidates(GPU, "cuda", PlanPolicy(), both) == [Plan(precision="fp16"), Plan(precision="bf16")]
    pinned = PlanPolicy(backend="openvino", precision="fp32")
    assert candidates(PLAIN, "cpu", pinned, both) == [Plan("openvino", "fp32", False)]
    absent = choose(_fake_runs({}), PROBE, AMX, "cpu", PlanPolicy(backend="openvino"))
    assert absent.plan == REFERENCE and absent.reason == "fp32 eager: the pinned backend openvino is not at hand here"


def _small_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 3),
    ).eval()


def _openvino_plan_round_trip(version: str) -> None:
    """Choose a pinned OpenVINO plan, adopt it from the cache without converting, and fall back when its stored
    model is broken: run in a process of its own (the test below says why)."""
    from rayline.ray_workloads.execution import openvino_backend

    forks: list[int] = []  # OpenVINO's telemetry posts from forked processes unless declined
    os.register_at_fork(before=lambda: forks.append(1))
    probe = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    policy = PlanPolicy(backend="openvino", precision="fp32")  # pinned: gated, whatever its speed
    first = _loaded(_small_cnn())
    chosen = plan_for(first, version, probe, policy)
    assert chosen.plan == Plan("openvino", "fp32", False), chosen.reason
    assert chosen.artifact is not None and chosen.prepare_s is not None
    stored = Path(version) / chosen.artifact
    assert sorted(p.name for p in stored.iterdir()) == ["model.bin", "model.xml"]
    expected = first.logits(probe)
    np.testing.assert_allclose(expected, torch_run(_small_cnn(), REFERENCE)(probe), atol=1e-4)

    def converting(*_: object) -> None:
        raise AssertionError("a stored model was converted again")

    openvino_backend.OpenVinoModel.convert = converting  # type: ignore[assignment,method-assign]
    restarted = _loaded(_small_cnn())
    adopted = plan_for(restarted, version, probe, policy)
    assert adopted.plan == chosen.plan and adopted.artifact == chosen.artifact
    np.testing.assert_allclose(restarted.logits(probe), expected, atol=1e-6)
    # a stored model that cannot be read is no plan: fp32 eager, saying why
    (stored / "model.xml").write_text("<not a model")
    broken = _loaded(_small_cnn())
    fallback = plan_for(broken, version, probe, policy)
    assert fallback.plan == REFERENCE and "plan's model could not be loaded" in fallback.reason
    np.testing.assert_allclose(broken.logits(probe), expected, atol=1e-4)
    assert not forks, "OpenVINO forked a process: its telemetry was not declined"


def test_an_openvino_plan_stores_its_converted_model_and_a_restart_reads_it_instead_of_converting(
    tmp_path: Path,
) -> None:
    """In a spawned process: once OpenVINO has run in a pytest process, test_service_records' drill of
    SIGINT/SIGTERM sent to itself ended that process with a segfault (2026-12-04, openvino 2026.4), so its
    native threads stay out of the process the other unit tests share."""
    pytest.importorskip("openvino")  # the rayline[openvino] extra (in dev): a CPU plan's backend
    process = multiprocessing.get_context("spawn").Process(
        target=_openvino_plan_round_trip, args=(str(tmp_path / "models" / "m" / "v1"),)
    )
    process.start()
    process.join(300)
    assert process.exitcode == 0, f"the OpenVINO round trip failed (exit code {process.exitcode}): see its stderr"
