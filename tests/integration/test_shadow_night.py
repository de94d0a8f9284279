"""A shadowed night: a second version scored on the same decoded images, its rows in shadow_predictions, the
champion's night and guarantees unchanged, the shadow committed with the night as one unit a rerun completes."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from rayline import storage
from rayline.errors import ConfigError
from rayline.flows.nightly_inference import NightRequest, nightly_inference
from rayline.models import registry
from rayline.ray_workloads.data import images
from rayline.ray_workloads.execution.plan import PlanPolicy
from rayline.ray_workloads.nightly import batch_inference, predictor
from rayline.ray_workloads.nightly.blocks import NightOutput
from rayline.ray_workloads.nightly.request import NightShape
from rayline.ray_workloads.quality import shadow as shadow_module
from rayline.seed import seed, seed_incoming
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, SHADOW_TABLE, table_uri
from rayline.tables.delta_tables import Night
from rayline.tables.predictions_table import night_seq
from tests.integration.helpers import register_untrained, register_untrained_champion

pytestmark = pytest.mark.integration

DAY = "2026-11-29"


class _Died(Exception):
    """Not transient: the task's retries leave it alone, as they would a driver that was killed."""


def _night_rows(root: str, table: str) -> pa.Table:
    partition = [("model_name", "=", "digits"), ("dt", "=", DAY)]
    return DeltaTable(table_uri(root, table)).to_pyarrow_table(partitions=partition)


def _exact_mean(column: pa.ChunkedArray) -> float:
    return float(sum((Fraction(float(v)) for v in column.to_numpy()), Fraction(0)) / len(column))


def _versions() -> tuple[registry.ModelVersion, registry.ModelVersion]:
    champion = register_untrained_champion()
    return champion, register_untrained(seed=1)


def test_the_shadow_scores_each_decoded_image_once_and_answers_as_it_would_alone(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    champion, shadow = _versions()
    incoming = storage.join(local_storage, "incoming", f"dt={DAY}")
    seed_incoming(incoming, corrupt=4)
    listed = sorted(storage.list_objects(incoming), key=lambda o: o.uri)[:120]
    uris, etags = [o.uri for o in listed], [o.etag for o in listed]
    decodes: list[int] = []
    real_decode = images.decode_image

    def counted(data: bytes, spec: Any, decode: Any = None) -> np.ndarray:
        decodes.append(1)
        return real_decode(data, spec, decode)

    monkeypatch.setattr(images, "decode_image", counted)  # decode_rows, the predictor's decode, calls it
    night = Night("digits", DAY)
    tables = [table_uri(local_storage, t) for t in (PREDICTIONS_TABLE, ERRORS_TABLE, SHADOW_TABLE)]
    constants = {"model_version": champion.version, "code_version": "test", "flow_run_id": ""}
    off = PlanPolicy(mode="off")  # fp32 eager: the shadow's answers compare exactly with the version's own

    shadowed = NightOutput(tables[0], tables[1], night, "run-shadowed", "kshadowed", tables[2])
    both = predictor.PredictorUDF(champion, 3, 64, 8, shadowed, constants, off, shadow)
    report = both.run_block("p0/b000000000", uris, etags)
    assert len(decodes) == len(uris), "each image decoded once for both versions"
    assert report.predictions + report.errors == len(uris) and report.errors >= 1
    assert report.shadow == report.predictions, "the shadow scored every image the champion predicted"

    alone = NightOutput(tables[0], tables[1], night, "run-alone", "kalone")
    by_itself = predictor.PredictorUDF(shadow, 3, 64, 8, alone, {**constants, "model_version": 2}, off)
    by_itself.run_block("p0/b000000000", uris, etags)

    def block_rows(output: NightOutput, kind: str) -> pa.Table:
        from rayline.ray_workloads.nightly.blocks import block_file_uri

        table = output.tables()[kind]
        return storage.read_parquet([block_file_uri(table, night, output.key, "p0/b000000000")]).sort_by("uri")

    shadow_rows, alone_rows = block_rows(shadowed, "shadow"), block_rows(alone, "predictions")
    assert set(shadow_rows["model_version"].to_pylist()) == {shadow.version}
    assert shadow_rows["uri"].to_pylist() == alone_rows["uri"].to_pylist()
    assert shadow_rows["predicted_class"].to_pylist() == alone_rows["predicted_class"].to_pylist()
    np.testing.assert_allclose(shadow_rows["confidence"].to_numpy(), alone_rows["confidence"].to_numpy(), rtol=1e-5)
    champion_rows = block_rows(shadowed, "predictions")
    assert set(champion_rows["model_version"].to_pylist()) == {champion.version}
    assert champion_rows["predicted_class"].to_pylist() != shadow_rows["predicted_class"].to_pylist()


def test_a_shadow_must_share_the_champions_classes_and_input() -> None:
    champion = registry.ModelVersion.model_validate({**_fake_version(1), "classes": [str(i) for i in range(10)]})
    other = registry.ModelVersion.model_validate({**_fake_version(2), "classes": ["cat", "dog"]})
    with pytest.raises(ConfigError, match=r"cannot shadow digits v1 with digits v2: its classes"):
        batch_inference.InferenceConfig(input_uri="/in", tables_root="/t", dt=DAY, model=champion, shadow=other)
    with pytest.raises(ConfigError, match="it is the version the night predicts with"):
        batch_inference.InferenceConfig(input_uri="/in", tables_root="/t", dt=DAY, model=champion, shadow=champion)


def _fake_version(version: int) -> dict[str, Any]:
    return {
        "name": "digits",
        "version": version,
        "uri": f"/r/digits/v{version}",
        "weights_uri": f"/r/digits/v{version}/model.pt",
        "model_spec": {"num_classes": 10, "width": 8},
        "image_spec": {"crop": 32},
        "classes": [str(i) for i in range(10)],
        "metrics": {},
        "data_manifest_uri": "-",
        "data_content_hash": "-",
        "code_version": "test",
        "registered_at": "2026-11-29T00:00:00+00:00",
    }


@pytest.mark.usefixtures("ray_session", "prefect_api")
def test_a_shadowed_night_commits_the_shadow_with_the_night_and_its_rerun_completes_it(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, shadow = _versions()
    # a small night (2 broken of 62, within the budget) in blocks of 16: still compacted from several blocks
    seed(storage.join(local_storage, "incoming", f"dt={DAY}"), corrupt=2, digit_count=60)
    monkeypatch.setattr(batch_inference, "objects_per_task", lambda cfg, count: 16)
    real_commit = batch_inference.commit_night

    def dies_before_the_predictions_commit(table: str, *args: Any, **kwargs: Any) -> Any:
        if table.endswith(f"/{PREDICTIONS_TABLE}"):
            raise _Died("injected: the driver died between the shadow's commit and the night's")
        return real_commit(table, *args, **kwargs)

    monkeypatch.setattr(batch_inference, "commit_night", dies_before_the_predictions_commit)
    with pytest.raises(_Died):
        nightly_inference(NightRequest(date=DAY, shape=NightShape(actors=1), shadow="v2"))
    night = Night("digits", DAY)
    assert night_seq(table_uri(local_storage, SHADOW_TABLE), night) == 1, "the shadow committed, the night not"
    assert night_seq(table_uri(local_storage, PREDICTIONS_TABLE), night) == 0
    assert set(_night_rows(local_storage, SHADOW_TABLE)["model_version"].to_pylist()) == {shadow.version}
    monkeypatch.setattr(batch_inference, "commit_night", real_commit)

    # the rerun shadows by RAYLINE_SHADOW_CHALLENGER: the challenger, whenever there is one, without --shadow
    registry.set_alias("digits", registry.CHALLENGER, shadow.version, "test")
    monkeypatch.setenv("RAYLINE_SHADOW_CHALLENGER", "1")
    result = nightly_inference(NightRequest(date=DAY, shape=NightShape(actors=1), max_error_fraction=0.05))
    monkeypatch.delenv("RAYLINE_SHADOW_CHALLENGER")
    assert isinstance(result, batch_inference.InferenceResult) and result.shadow is not None
    assert night_seq(table_uri(local_storage, SHADOW_TABLE), night) == 2, "the rerun replaced the shadow's rows"
    served, shadowed = _night_rows(local_storage, PREDICTIONS_TABLE), _night_rows(local_storage, SHADOW_TABLE)
    # the champion's night as ever: one row per input, its budget its own
    assert served.num_rows == result.predictions and result.predictions + result.errors == result.inputs
    assert result.data_files == {"predictions": 1, "errors": 1, "shadow": 1}, "compacted: one file per table"
    assert set(served["model_version"].to_pylist()) == {1} and set(shadowed["model_version"].to_pylist()) == {2}
    assert sorted(shadowed["uri"].to_pylist()) == sorted(served["uri"].to_pylist())
    columns = ["uri", "predicted_class", "confidence"]
    joined = served.select(columns).join(shadowed.select(columns), "uri", right_suffix="_s")
    agree = pc.sum(pc.equal(joined["predicted_class"], joined["predicted_class_s"])).as_py() / joined.num_rows
    summary = result.shadow
    assert summary.model_version == shadow.version and summary.compared == served.num_rows
    # summed block by block, reused blocks' counts read back from their footers: the committed files' figures
    assert summary.agreement == agree
    assert summary.shadow_mean_confidence == _exact_mean(joined["confidence_s"])
    assert summary.mean_confidence == _exact_mean(joined["confidence"])
    assert sum(summary.shadow_class_counts.values()) == served.num_rows
    assert 0.0 <= summary.class_shift <= 1.0

    # a retry of the run whose commits landed returns the shadow's night too, predicting nothing
    config = batch_inference.InferenceConfig(
        input_uri=result.input_uri,
        tables_root=local_storage,
        dt=DAY,
        model=registry.resolve("digits", 1),
        shadow=shadow,
    )
    again = batch_inference.run(config, result.run_id)
    assert again.already_committed and again.shadow == summary
    # the monitor's reading of the night's shadow, gone once the night is run again without one
    assert shadow_module.night_summaries(local_storage, "digits", [DAY]) == {DAY: summary}
    # the challenger alias stays, the setting is off: no shadow
    unshadowed = nightly_inference(NightRequest(date=DAY, shape=NightShape(actors=1)))
    assert isinstance(unshadowed, batch_inference.InferenceResult) and unshadowed.shadow is None
    assert shadow_module.night_summaries(local_storage, "digits", [DAY]) == {}
