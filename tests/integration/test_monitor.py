"""monitor on real committed partitions: images unlike training drift, digits don't; the drift event is emitted."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from rayline import events, storage
from rayline.cli import app
from rayline.cli.common import ExitCode
from rayline.flows.import_labels import LabelsImportRequest, import_labels
from rayline.flows.monitor import MonitorRequest, monitor
from rayline.flows.nightly_inference import NightRequest, nightly_inference
from rayline.flows.prepare_data import PrepareRequest, prepare_data
from rayline.models import registry
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
from rayline.ray_workloads.monitoring.monitor import DriftThresholds
from rayline.ray_workloads.quality.labels_import import LabelsImportResult
from rayline.ray_workloads.training.loop import TrainLoopConfig, in_memory_batches, make_optimizer, run_epoch
from rayline.seed import digit_objects, seed, synthetic_objects

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]


def _train_champion(root: str) -> None:
    """A few in-process epochs on the prepared digits: a model that knows them, registered as champion."""
    prepared = prepare_data(PrepareRequest(source_uri=storage.join(root, "raw"))).preprocess
    table = storage.read_parquet(prepared.read_files()["train"]).sort_by("key")  # shard order varies run to run
    data = {
        "image": torch.from_numpy(table.column("image").combine_chunks().to_numpy_ndarray().copy()),
        "label_index": torch.from_numpy(table.column("label_index").to_numpy().copy()),
    }
    spec = ModelSpec(num_classes=len(prepared.classes), width=16)
    torch.manual_seed(0)  # a fixed start: the familiar partition's PSI must not depend on the draw
    model, loop = build_model(spec), TrainLoopConfig(model=spec, lr=3e-3)
    optimizer = make_optimizer(model, loop)
    for epoch in range(12):
        run_epoch(model, in_memory_batches(data, 32, epoch), torch.device("cpu"), optimizer)
    version = registry.register(
        "digits",
        state_dict_bytes(model),
        model_spec=spec.model_dump(),
        image_spec=prepared.image.model_dump(),
        classes=prepared.classes,
        metrics={},
        data_manifest_uri=prepared.manifest_uri,
        data_content_hash=prepared.input_content_hash,
        code_version="test",
    )
    registry.set_alias("digits", registry.CHAMPION, version.version, "test")


def _drop(root: str, day: str, objects: list[tuple[str, bytes]]) -> None:
    for key, data in objects:
        storage.write_bytes_atomic(storage.join(root, "incoming", f"dt={day}", key), data)


def _label_familiar_night(root: str, day: str) -> Path:
    """People's labels for the night's digits (the folder a digit was seeded under is its class), keyed
    under the incoming prefix, plus one row with a class the model lacks: every photo of the night labelled,
    a census, imported as random."""
    path = Path(root).parent / "labels.csv"
    rows = [f"dt={day}/{key},{key.split('/')[0]}" for key, _ in list(digit_objects(32))[::3]]
    path.write_text("key,label\n" + "\n".join([*rows, f"dt={day}/0/digit-00000.png,eleven"]) + "\n")
    return path


async def _events(api: str, name: str, since: float) -> list[dict[str, object]]:
    async with httpx.AsyncClient(base_url=api) as client:
        answer = await client.post(
            "/events/filter", json={"filter": {"event": {"name": [name]}, "occurred": {"since": _iso(since)}}}
        )
        answer.raise_for_status()
        return list(answer.json()["events"])


def _iso(unix: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(unix, UTC).isoformat()


def test_drift_is_detected_on_unfamiliar_images_only(local_storage: str, prefect_api: str) -> None:
    import asyncio

    began = time.time()
    seed(storage.join(local_storage, "raw"))
    _train_champion(local_storage)
    _drop(local_storage, "2026-11-27", list(digit_objects(32))[::3])  # like training
    _drop(local_storage, "2026-11-28", list(synthetic_objects(600, 32, np.random.default_rng(5))))  # unlike it
    for day in ("2026-11-27", "2026-11-28"):
        nightly_inference(NightRequest(date=day, max_error_fraction=0.0))

    labels_file = _label_familiar_night(local_storage, "2026-11-27")
    answer = CliRunner().invoke(app, ["labels", "import", str(labels_file), "--selection", "random", "--json"])
    assert answer.exit_code == ExitCode.REFUSED, answer.output  # a row was refused: the others are in
    imported = LabelsImportResult.model_validate_json(answer.stdout)
    assert (imported.imported, imported.rejected) == (len(list(digit_objects(32))[::3]), {"unknown_class": 1})
    assert import_labels(
        LabelsImportRequest(file=str(labels_file))
    ).already_imported  # the same file again adds nothing

    started = time.time()
    result = monitor(MonitorRequest(partitions=2, check_serving=False))
    verdicts = {p.partition: p for p in result.partitions}
    familiar, unfamiliar = verdicts["dt=2026-11-27"], verdicts["dt=2026-11-28"]
    assert not familiar.drifted and familiar.psi < DriftThresholds().psi / 2, familiar
    assert unfamiliar.drifted and unfamiliar.reasons, unfamiliar

    # the maintenance step ran for real: nothing is older than the default 168 h retention yet
    assert result.vacuum_retention_hours == 168 and result.files_vacuumed == 0
    metrics = storage.read_bytes(result.metrics_uri).decode()
    nights = {
        s.labels["night"]: s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "rayline_predictions_night_timestamp_seconds"
        for s in family.samples
    }
    assert nights == {
        "0": datetime(2026, 11, 28, tzinfo=UTC).timestamp(),
        "1": datetime(2026, 11, 27, tzinfo=UTC).timestamp(),
    }

    (quality,) = result.quality  # only the familiar night has labels
    assert (quality.dt, quality.model_version, quality.labelled) == ("2026-11-27", 1, imported.imported)
    assert quality.accuracy > 0.8 and 0 <= quality.ece < 0.5 and set(quality.recall) == {str(d) for d in range(10)}
    exported = {
        (family.name, s.labels["model_version"], s.labels["night"]): s.value
        for family in text_string_to_metric_families(metrics)
        if family.name in ("rayline_quality_accuracy", "rayline_quality_labelled")
        for s in family.samples
    }
    assert exported == {
        ("rayline_quality_accuracy", "1", "0"): pytest.approx(quality.accuracy),
        ("rayline_quality_labelled", "1", "0"): quality.labelled,
    }

    deadline = time.monotonic() + 30  # events reach the server's store asynchronously
    while not (found := asyncio.run(_events(prefect_api, events.DRIFT_DETECTED, started))):
        assert time.monotonic() < deadline, "no drift event"
        time.sleep(1)
    assert [e["resource"]["prefect.resource.id"] for e in found] == [  # type: ignore[index]
        f"rayline.predictions.{unfamiliar.night}"
    ]
    # the standalone prepare-data of the seed announced 1797 labelled arrivals, enough to retrain on
    (arrived,) = asyncio.run(_events(prefect_api, events.DATA_ARRIVED, began))
    assert arrived["resource"][events.RETRAIN_LABEL] == "true", arrived  # type: ignore[index]
    assert arrived["payload"]["new_labelled"] == 1797, arrived  # type: ignore[index]
