"""ONNX Runtime as an fp32 plan for torch modules on CPUs: a candidate where it is at hand, its bar, its cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rayline.hardware import Hardware
from rayline.ray_workloads.execution import onnx_backend
from rayline.ray_workloads.execution.cache import plan_for
from rayline.ray_workloads.execution.interface import LoadedModel
from rayline.ray_workloads.execution.plan import (
    MIN_SPEEDUP,
    MIN_SPEEDUP_FP32,
    REFERENCE,
    Backend,
    Plan,
    PlanPolicy,
    candidates,
    choose,
    torch_run,
)
from rayline.specs import ModelSpec
from tests.unit.test_execution_plan import AMX, BF16, GPU, PLAIN, PROBE, _fake_runs, _small_cnn

pytestmark = pytest.mark.unit

ORT = Plan("onnxruntime", "fp32", False)
AT_HAND: tuple[Backend, ...] = ("eager", "onnxruntime")


def test_onnx_runtime_is_an_fp32_candidate_on_every_cpu_where_it_is_at_hand() -> None:
    assert candidates(PLAIN, "cpu", PlanPolicy(), AT_HAND) == [ORT]  # no bf16 path: fp32 on another backend
    assert candidates(BF16, "cpu", PlanPolicy(), AT_HAND) == [Plan(precision="bf16"), ORT]
    assert candidates(PLAIN, "cpu", PlanPolicy(), ("eager",)) == []  # not installed, or turned off
    assert candidates(GPU, "cuda", PlanPolicy(), AT_HAND) == [Plan(precision="fp16"), Plan(precision="bf16")]
    assert candidates(AMX, "cpu", PlanPolicy(precision="fp32"), AT_HAND) == []  # fp32 pinned: the reference
    assert candidates(AMX, "cpu", PlanPolicy(precision="bf16"), AT_HAND) == [Plan(precision="bf16")]
    assert candidates(PLAIN, "cpu", PlanPolicy(backend="onnxruntime"), AT_HAND) == [ORT]


def test_an_fp32_candidate_needs_only_to_pay_for_its_conversion() -> None:
    """Its answers are the reference's to float rounding, so its bar is lower than a narrower precision's."""
    assert 1 < MIN_SPEEDUP_FP32 < MIN_SPEEDUP
    faster = 1 / ((MIN_SPEEDUP_FP32 + MIN_SPEEDUP) / 2)  # seconds a call, against the reference's 1
    runs = _fake_runs({REFERENCE.name: 0.02, ORT.name: 0.02 * faster, Plan(precision="bf16").name: 0.02 * faster})
    assert choose(runs, PROBE, PLAIN, "cpu", PlanPolicy(), AT_HAND).plan == ORT
    refused = choose(runs, PROBE, BF16, "cpu", PlanPolicy(), ("eager",))
    assert refused.plan == REFERENCE and "is not faster than fp32's" in refused.reason


def test_an_onnx_plan_answers_as_fp32_is_stored_and_a_restart_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("onnxruntime")  # the rayline[onnx] extra (in dev)
    version = str(tmp_path / "models" / "m" / "v1")
    probe = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    policy = PlanPolicy(backend="onnxruntime")  # pinned: gated, whatever its speed

    def loaded() -> LoadedModel:
        module = _small_cnn()
        return LoadedModel(ModelSpec(arch="resnet18", num_classes=3), None, torch_run(module, REFERENCE), module)

    first = loaded()
    chosen = plan_for(first, version, probe, policy, ())
    assert chosen.plan == ORT and chosen.artifact is not None, chosen.reason
    assert [p.name for p in (Path(version) / chosen.artifact).iterdir()] == [onnx_backend.MODEL_FILE]
    expected = torch_run(_small_cnn(), REFERENCE)(probe)
    np.testing.assert_allclose(first.logits(probe), expected, atol=1e-5)

    monkeypatch.setattr(onnx_backend.OnnxModel, "convert", lambda *_: pytest.fail("a stored model was converted"))
    restarted = loaded()
    assert plan_for(restarted, version, probe, policy).artifact == chosen.artifact
    np.testing.assert_allclose(restarted.logits(probe), expected, atol=1e-5)
    (Path(version) / chosen.artifact / onnx_backend.MODEL_FILE).write_bytes(b"not a model")
    broken = loaded()
    fallback = plan_for(broken, version, probe, policy)
    assert fallback.plan == REFERENCE and "plan's model could not be loaded" in fallback.reason
    np.testing.assert_allclose(broken.logits(probe), expected, atol=1e-6)
    with pytest.raises(ValueError, match="fp32 only"):
        onnx_backend.OnnxModel(b"", 0.0).run("bf16")


def test_a_plain_cpu_names_onnx_runtime_in_its_hardware_free_reason() -> None:
    """Where nothing is at hand the reason is still the plain CPU's: no reduced-precision path."""
    choice = choose(_fake_runs({}), PROBE, Hardware("Plain CPU", ("avx2",)), "cpu", PlanPolicy(), ("eager",))
    assert choice.plan == REFERENCE and "no reduced-precision fast path" in choice.reason
