"""The plan's gate refuses outputs that are not numbers; a night predicts again in fp32 what its plan cannot answer.

The overflow is real: a model whose fp16 activations pass 65,504 on bright
images only (tests/fp16_overflow.py), run under a pinned fp16 plan, which
torch's autocast measures on any CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from rayline import storage
from rayline.hardware import Hardware
from rayline.models import registry
from rayline.ray_workloads.architectures.build import build_model, prepare_for_inference, state_dict_bytes
from rayline.ray_workloads.execution.cache import cached_plan, demote, demote_overflowing, plan_for, plan_uri
from rayline.ray_workloads.execution.fallback import DEMOTE_SHARE, PlanUse
from rayline.ray_workloads.execution.interface import LoadedModel
from rayline.ray_workloads.execution.plan import (
    REFERENCE,
    Logits,
    Plan,
    PlanPolicy,
    choose,
    plans_text,
    torch_run,
)
from rayline.ray_workloads.nightly.blocks import BlockReport, NightOutput, block_file_uri
from rayline.ray_workloads.nightly.compaction import NightTotals
from rayline.ray_workloads.nightly.predictor import PredictorUDF
from rayline.storage.digests import SetDigest
from rayline.tables.delta_tables import Night
from tests.fp16_overflow import (
    BRIGHT_PEAK,
    DIM_PEAK,
    IMAGE,
    SPEC,
    decoded,
    digit_pngs,
    overflowing_small_cnn,
)

pytestmark = pytest.mark.unit

CPU = Hardware("Plain CPU", ("avx2",))
FP16 = Plan(precision="fp16")
PINNED = PlanPolicy(precision="fp16")
PROBE = np.zeros((4, 3, 8, 8), np.float32)


def _answers(reference: np.ndarray, candidate: np.ndarray) -> Callable[[Plan], Logits]:
    """Plans that answer at once: the reference ``reference``, the fp16 candidate ``candidate``."""

    def make(plan: Plan) -> Logits:
        return lambda batch: reference if plan == REFERENCE else candidate

    return make


def _sure_of_class_0() -> np.ndarray:
    logits = np.zeros((len(PROBE), 5), np.float32)
    logits[:, 0] = 4.0
    return logits


@pytest.mark.parametrize("not_a_number", [np.inf, -np.inf, np.nan])
def test_a_candidate_emitting_inf_or_nan_is_refused_though_its_other_answers_agree(not_a_number: float) -> None:
    """A NaN row's argmax is class 0 and NaN passes every bound: the reference's class 0 looks agreed with."""
    candidate = _sure_of_class_0()
    candidate[2, 0] = not_a_number
    choice = choose(_answers(_sure_of_class_0(), candidate), PROBE, CPU, "cpu", PINNED)
    assert choice.plan == REFERENCE, choice.reason
    assert choice.reason == (
        "fp32 eager: eager/fp16/channels-last refused: outputs not finite (inf or NaN) on 1 of 4 probe images"
    )


def test_a_model_whose_own_fp32_outputs_are_not_finite_runs_fp32_and_says_why_instead_of_judging_plans() -> None:
    reference = _sure_of_class_0()
    reference[1, 3] = np.nan
    choice = choose(_answers(reference, _sure_of_class_0()), PROBE, CPU, "cpu", PINNED)
    assert choice.plan == REFERENCE and choice.gate is None
    assert choice.reason == (
        "fp32 eager: the model's own fp32 outputs are not finite (inf or NaN) on 1 of 4 probe images, "
        "so no other plan can be judged against them"
    )


@pytest.fixture(scope="module")
def overflowing() -> torch.nn.Module:
    return prepare_for_inference(overflowing_small_cnn())


@pytest.fixture(scope="module")
def dim() -> np.ndarray:
    return decoded(digit_pngs(range(16), DIM_PEAK))


@pytest.fixture(scope="module")
def bright() -> np.ndarray:
    return decoded(digit_pngs(range(16, 20), BRIGHT_PEAK))


def _loaded(module: torch.nn.Module) -> LoadedModel:
    return LoadedModel(SPEC, IMAGE, torch_run(module, REFERENCE), module)


def test_fp16_on_a_real_overflow_passes_the_gate_on_dim_images_and_is_refused_once_a_bright_one_is_probed(
    overflowing: torch.nn.Module, dim: np.ndarray, bright: np.ndarray
) -> None:
    assert not np.isfinite(torch_run(overflowing, FP16)(bright)).any(), "fp16 overflows on bright images"
    assert _loaded(overflowing).choose_plan(dim, PINNED, CPU).plan == FP16
    probed = _loaded(overflowing).choose_plan(np.concatenate([dim, bright[:1]]), PINNED, CPU)
    assert probed.plan == REFERENCE
    assert "refused: outputs not finite (inf or NaN) on 1 of 17 probe images" in probed.reason


def test_a_batch_the_fp16_plan_overflows_on_is_predicted_again_in_fp32_and_counted(
    overflowing: torch.nn.Module, dim: np.ndarray, bright: np.ndarray
) -> None:
    model = _loaded(overflowing)
    assert model.choose_plan(dim, PINNED, CPU).plan == FP16
    mixed = np.concatenate([dim[:3], bright[:1]])
    fp32, fp16 = torch_run(overflowing, REFERENCE), torch_run(overflowing, FP16)
    np.testing.assert_array_equal(model.logits(dim[:4]), fp16(dim[:4]))  # the plan runs where it can
    np.testing.assert_array_equal(model.logits(mixed), fp32(mixed))  # fp32's answers, the whole batch
    assert model.use == PlanUse(batches=2, fallback_batches=1, fallback_images=4)
    assert np.isfinite(model.probabilities(bright)).all()


def _fp16_cached(version: str, module: torch.nn.Module, probe: np.ndarray) -> str:
    chosen = plan_for(_loaded(module), version, probe, PINNED)
    assert chosen.plan == FP16 and chosen.key is not None, chosen.reason
    return chosen.key


def test_a_plan_that_fell_back_in_over_1_percent_of_a_nights_batches_is_replaced_in_the_cache_by_fp32(
    tmp_path: Path, overflowing: torch.nn.Module, dim: np.ndarray
) -> None:
    version = str(tmp_path / "models" / "m" / "v1")
    key = _fp16_cached(version, overflowing, dim)
    allowed = int(DEMOTE_SHARE * 200)
    night = "the night m dt=2026-11-28"
    assert demote_overflowing(version, {(FP16.name, key): PlanUse(200, allowed, 4 * allowed)}, night) == {}
    assert plan_for(_loaded(overflowing), version, dim, PINNED).plan == FP16  # within the share: kept

    demoted = demote_overflowing(version, {(FP16.name, key): PlanUse(200, allowed + 1, 12)}, night)
    reason = (
        "fp32 eager: eager/fp16/channels-last demoted on the night m dt=2026-11-28, 3 of 200 batches (12 images) "
        "predicted again in fp32: outputs not finite, over the 1% of a night's batches a plan may need fp32 for"
    )
    assert demoted == {FP16.name: reason}
    later = _loaded(overflowing)
    adopted = plan_for(later, version, dim, PINNED)
    assert (adopted.plan, adopted.reason, adopted.key) == (REFERENCE, reason, key)
    np.testing.assert_array_equal(later.logits(dim), torch_run(overflowing, REFERENCE)(dim))
    record = json.loads(Path(plan_uri(version, key)).read_text())
    assert record["replaced"]["plan"] == FP16.name and record["policy"] == PINNED.model_dump(mode="json")
    assert demote(version, key, "again") is None, "the reference is not demoted"
    assert cached_plan(plan_uri(version, key)).reason == reason  # type: ignore[union-attr]


def _block(name: str, plan: dict[str, object]) -> BlockReport:
    return BlockReport(name, 4, 0, 100, 10, SetDigest.of([name]), plan=plan)


def test_a_nights_totals_add_each_blocks_fallbacks_per_plan_and_say_them_in_its_summary() -> None:
    totals = NightTotals()
    record = {"plan": FP16.name, "reason": "eager/fp16/channels-last: pinned", "key": "k1"}
    for name, use in (("a", PlanUse(8, 0, 0)), ("b", PlanUse(8, 2, 8)), ("c", PlanUse(1, 1, 3))):
        totals.add(_block(f"p/{name}", {**record, **use.record()}))
    totals.add(_block("p/d", {"plan": FP16.name, "key": "k2", **PlanUse(4, 0, 0).record()}))  # another machine
    assert totals.plan_use == {(FP16.name, "k1"): PlanUse(17, 3, 11), (FP16.name, "k2"): PlanUse(4, 0, 0)}
    plans = totals.plan_records({FP16.name: "fp32 eager: demoted"})
    assert PlanUse.from_record(plans[FP16.name]) == PlanUse(21, 3, 11)
    assert plans_text(plans) == (
        "eager/fp16/channels-last: pinned (3 of 21 batches (11 images) predicted again in fp32: outputs not finite); "
        "later nights: fp32 eager: demoted"
    )


def test_a_row_whose_fp32_scores_are_not_numbers_is_an_error_row_not_a_prediction_of_class_0(
    local_storage: str,
) -> None:
    torch.manual_seed(0)
    broken = build_model(SPEC)
    with torch.no_grad():
        broken.head[-1].weight[:, 0] = float("nan")  # a NaN on every input's scores
    version = registry.register("nan", state_dict_bytes(broken), model_spec=SPEC, image_spec=IMAGE,
                                classes=[str(i) for i in range(10)], metrics={}, code_version="test")  # fmt: skip
    for key, data in digit_pngs(range(3), DIM_PEAK):
        storage.write_bytes_atomic(storage.join(local_storage, "in", key), data)
    objects = storage.list_objects(storage.join(local_storage, "in"))
    output = NightOutput(
        storage.join(local_storage, "p"), storage.join(local_storage, "e"), Night("nan", "2026-11-28"), "r", "k"
    )
    constants = {"model_version": 1, "code_version": "test", "flow_run_id": ""}
    predictor = PredictorUDF(version, 3, 4, 8, output, constants, PlanPolicy(mode="off"))
    report = predictor.run_block("g00000-00000/b000000000", [o.uri for o in objects], [o.etag for o in objects])
    assert (report.predictions, report.errors, report.error_types) == (0, 3, {"NonFiniteOutput": 3})
    errors = storage.read_parquet([block_file_uri(output.errors_table, output.night, "k", report.block)])
    assert set(errors.column("stage").to_pylist()) == {"predict"}
    assert report.plan["batches"] == 1 and report.plan["fallback_batches"] == 0
