"""A night of photos through an outside model: keyed by model, class names, monitor vs a reference night, lineage.

ResNet-18 with random weights at a 64 px crop (``register_outside``) and a
couple of dozen photos: the tests check delivery, layout and the monitor's
reference, not accuracy.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from typer.testing import CliRunner

from rayline import storage
from rayline.cli import app
from rayline.flows.monitor import MonitorRequest, monitor
from rayline.flows.nightly_inference import NightRequest, nightly_inference
from rayline.lineage.graph import build_graph, render_text
from rayline.lineage.records import lineage_dir
from rayline.ray_workloads.architectures.build import imagenet_classes
from rayline.ray_workloads.nightly.batch_inference import InferenceResult
from rayline.ray_workloads.nightly.blocks import NightOutput, block_file_uri
from rayline.ray_workloads.nightly.request import NightShape
from rayline.seed import EXPECTED_ERROR_TYPE, digit_objects, photo_variant, seed, source_photos
from rayline.tables.delta_tables import Night
from rayline.tables.prediction_reads import read_night_pair
from tests.integration.helpers import register_outside, register_untrained_champion

pytestmark = pytest.mark.integration
on_ray_and_prefect = pytest.mark.usefixtures("ray_session", "prefect_api")

DAY, NEXT_DAY = "2026-11-28", "2026-11-29"


def _photos_day(root: str, day: str, photos: int, corrupt: int, large: int) -> tuple[str, set[str], dict[str, str]]:
    """A day of photos under ``incoming/photos/dt=<day>``: (prefix, input URIs, broken URI → expected error)."""
    incoming = storage.join(root, "incoming", "photos", f"dt={day}")
    seeded = seed(incoming, photos=photos, corrupt=corrupt, digits=False)
    rng = np.random.default_rng(7)
    for index in range(large):  # over 2 megapixels each, whatever the seed's draw gave
        data, _ = photo_variant(source_photos()[index % 2], rng, large=True)
        storage.write_bytes_atomic(storage.join(incoming, f"large/photo-{index}.jpg"), data)
    broken = {storage.join(incoming, key): EXPECTED_ERROR_TYPE[kind] for key, kind in seeded.corrupt.items()}
    return incoming, {o.uri for o in storage.list_objects(incoming)}, broken


@on_ray_and_prefect
def test_a_photos_night_on_s3_is_keyed_by_model_next_to_a_digits_night_of_the_same_day(s3_storage: str) -> None:
    version = register_outside()
    incoming, inputs, broken = _photos_day(s3_storage, DAY, photos=19, corrupt=3, large=2)
    assert len(inputs) == 24

    # 3 broken in 24 is over the default 5 % budget: the night is committed, then the command fails
    cli = CliRunner().invoke(
        app, ["nightly-inference", "--model", "photos@champion", "--date", DAY, "--source", incoming, "--actors", "1"]
    )
    assert cli.exit_code == 3 and "3 of 24 inputs failed" in cli.output, cli.output
    night = read_night_pair(s3_storage, "photos", DAY)
    predictions, errors = night.predictions, night.errors
    predicted, errored = predictions.column("uri").to_pylist(), errors.column("uri").to_pylist()
    assert sorted(predicted + errored) == sorted(inputs), "exactly one row per input"
    assert {r["uri"]: r["error_type"] for r in errors.to_pylist()} == broken
    assert set(errors.column("stage").to_pylist()) == {"decode"}
    # the decode was judged on the night's photos as bytes (random weights: answers near a tie, most likely
    # full decoding), and each row names it
    (plan,) = set(predictions.column("plan").to_pylist())
    assert "+decode-" in plan, plan

    names = set(imagenet_classes("resnet18"))
    for row in predictions.to_pylist():
        assert row["model_name"] == "photos" and row["dt"] == DAY and row["model_version"] == version.version
        assert len(row["top_k_class"]) == len(row["top_k_index"]) == 3
        assert row["top_k_class"] == [version.classes[i] for i in row["top_k_index"]]
        assert row["top_k_class"][0] == row["predicted_class"] and set(row["top_k_class"]) <= names

    # the digits' night of the same day is its own partition: neither replaces the other
    register_untrained_champion()
    digits_in = storage.join(s3_storage, "incoming", f"dt={DAY}")
    for key, data in list(digit_objects(32))[:12]:
        storage.write_bytes_atomic(storage.join(digits_in, key), data)
    digits = nightly_inference(
        NightRequest(date=DAY, model="champion", model_name="digits", shape=NightShape(actors=1))
    )
    assert isinstance(digits, InferenceResult)
    assert digits.predictions_table == storage.join(s3_storage, "predictions") and digits.night == f"digits/dt={DAY}"
    assert read_night_pair(s3_storage, "digits", DAY).predictions.num_rows == 12
    photos_again = read_night_pair(s3_storage, "photos", DAY)
    assert sorted(photos_again.predictions.column("uri").to_pylist()) == sorted(predicted)
    assert photos_again.commit == night.commit, "the digits' commit left the photos' night as it was"


@on_ray_and_prefect
def test_monitor_and_lineage_of_an_outside_champions_nights(local_storage: str) -> None:
    version = register_outside()
    for day in (DAY, NEXT_DAY):
        incoming, _, _ = _photos_day(local_storage, day, photos=10, corrupt=0, large=0)
        nightly_inference(NightRequest(date=day, model_name="photos", input_uri=incoming, shape=NightShape(actors=1)))

    # no training labels: the first committed night is the reference (judged against itself: no drift)
    result = monitor(MonitorRequest(model_name="photos", partitions=2, check_serving=False))
    by_day = {p.partition: p for p in result.partitions}
    assert set(by_day) == {f"dt={DAY}", f"dt={NEXT_DAY}"}
    first = by_day[f"dt={DAY}"]
    assert first.reference == f"reference night dt={DAY}" and first.psi == pytest.approx(0.0)
    assert not first.drifted, first
    counts = Counter(read_night_pair(local_storage, "photos", DAY).predictions.column("predicted_class").to_pylist())
    assert first.reference_share == pytest.approx({k: v / counts.total() for k, v in counts.items()})
    assert result.metrics_uri == storage.join(local_storage, "monitoring", "photos.prom")
    metrics = storage.read_bytes(result.metrics_uri).decode()
    # both nights, as "nights back" (bounded labels), their dates as values
    assert 'night="0"' in metrics and 'night="1"' in metrics and 'model="photos"' in metrics
    assert all(p.core_seconds for p in result.partitions), "each night's commit records what it cost"
    assert "rayline_predictions_core_seconds{" in metrics and "rayline_predictions_images_per_core_second{" in metrics

    named = monitor(MonitorRequest(model_name="photos", partitions=1, check_serving=False, reference_date=NEXT_DAY))
    (latest,) = named.partitions
    assert latest.reference == f"reference night dt={NEXT_DAY}" and latest.psi == pytest.approx(0.0)
    missing = monitor(
        MonitorRequest(model_name="photos", check_serving=False, reference_date="2026-01-01"), return_state=True
    )
    assert missing.is_failed() and "no committed night photos dt=2026-01-01" in str(missing.message)

    # lineage: the night → the model version → where its weights came from (no training run)
    graph = build_graph(storage.join(local_storage, "predictions", Night("photos", DAY).relative_dir))
    model = next(n for n in graph.upstream if n.kind == "model version")
    assert model.uri == version.uri and model.details["name"] == "photos"
    assert model.details["weights_source"]["uri"] == "test://random-weights"
    (weights,) = [n for n in model.upstream if n.kind == "outside weights"]
    assert weights.uri == "test://random-weights" and weights.content_hash == "seed-0"
    assert "training run" not in [n.kind for n in model.upstream]
    assert "outside weights  test://random-weights  (sha256 seed-0)" in render_text(graph)
    # each night's record names the plan its rows came from, the decode judged on the night's photos with it
    records = [json.loads(storage.read_bytes(o.uri)) for o in storage.list_objects(lineage_dir("batch_inference"))]
    plans = [i["facets"]["plans"] for r in records for i in r["inputs"] if "plans" in i["facets"]]
    assert len(plans) == 2 and all(p["decode"] and p["decode_reason"] for night in plans for p in night.values())


def test_a_block_predicted_in_small_chunks_gives_the_rows_of_one_chunk(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The predictor bounds the pixels it holds by chunking a block; the written rows do not depend on it."""
    from rayline.ray_workloads.nightly import predictor as ip

    version = register_outside()
    incoming, inputs, broken = _photos_day(local_storage, DAY, photos=9, corrupt=2, large=1)
    objects = storage.list_objects(incoming)
    uris, etags = [o.uri for o in objects], [o.etag for o in objects]

    def rows(run: str) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
        output = NightOutput(
            storage.join(local_storage, run, "predictions"),
            storage.join(local_storage, run, "errors"),
            Night("photos", DAY),
            run,
            "k0",
        )
        predictor = ip.PredictorUDF(
            version, 3, 4, 8, output, {"model_version": version.version, "code_version": "test", "flow_run_id": ""}
        )
        block = "g00000-00000/b000000000"
        predictor.run_block(block, uris, etags)
        tables = {
            kind: storage.read_parquet([block_file_uri(table, output.night, output.key, block)]).sort_by("uri")
            for kind, table in (("predictions", output.predictions_table), ("errors", output.errors_table))
        }
        return tables["predictions"].to_pylist(), tables["errors"].to_pylist()

    whole = rows("whole")
    monkeypatch.setattr(ip, "DECODED_BYTES_PER_CHUNK", 1)  # chunks of one batch (4): 3 chunks of 12 objects
    assert ip.chunk_size(version.image_spec.size, 4) == 4
    chunked = rows("chunked")
    assert [r["uri"] for r in chunked[0]] == [r["uri"] for r in whole[0]]
    for a, b in zip(chunked[0], whole[0], strict=True):
        assert a["top_k_class"] == b["top_k_class"] and a["top_k_prob"] == pytest.approx(b["top_k_prob"], abs=1e-5)
    assert {r["uri"]: r["error_type"] for r in chunked[1]} == broken == {r["uri"]: r["error_type"] for r in whole[1]}
    assert len(chunked[0]) + len(chunked[1]) == len(inputs) == 12
