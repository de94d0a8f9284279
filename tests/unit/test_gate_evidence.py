"""The labelled gate keeps its promise on the labels the queue chooses: a no-better challenger passes at most
alpha/(1-beta) of the time however often it is asked, counting only photos drawn at random that neither
version learned; a better one still passes, within a stated number of nights at the default budget.

The loop is simulated as a user runs it (``tests/unit/label_loop_simulation.py``): rayline's own queue picks
the night's photos, people label them, the gate judges the challenger after every night.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from rayline import storage
from rayline.models import registry
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, state_dict_bytes
from rayline.ray_workloads.quality import labels_import, queue, reading, training_set
from rayline.ray_workloads.quality.paired import PairedTestPolicy
from rayline.storage import layout
from rayline.tables import prediction_reads
from tests.unit.label_loop_simulation import Loop, passes_within
from tests.unit.test_quality import commit_night

pytestmark = pytest.mark.unit

POLICY = PairedTestPolicy()
PROMISED = POLICY.alpha / (1 - POLICY.beta)  # 6.25 %
TRIALS = 80
NIGHTS = 5


def _within_sampling_error(rate: float, trials: int) -> float:
    """The promised bound plus three standard errors of a rate measured on ``trials`` trials."""
    return PROMISED + 3 * math.sqrt(PROMISED * (1 - PROMISED) / trials)


@pytest.mark.parametrize("correlation", [0.0, 0.5, 0.8])
def test_a_no_better_challenger_passes_at_most_the_promised_rate_on_the_labels_the_queue_chooses(
    correlation: float,
) -> None:
    """Two versions of 85 % accuracy, informative confidence, five nights of 2,000 photos, 200 labels a night
    chosen by the queue (uncertainty, shadow disagreement, and its default random share)."""
    same = Loop(champion_accuracy=0.85, challenger_accuracy=0.85, correlation=correlation)
    passed = [passes_within(same, NIGHTS, seed) is not None for seed in range(TRIALS)]
    assert np.mean(passed) <= _within_sampling_error(PROMISED, TRIALS), f"passed {np.mean(passed):.1%}"
    # the control: counting every label the queue chose, the same loop passes it nearly always
    counting_all = Loop(0.85, 0.85, correlation, targeted_only=True)
    assert np.mean([passes_within(counting_all, NIGHTS, seed) is not None for seed in range(20)]) > 0.5


def test_a_challenger_five_points_better_passes_within_ten_nights_at_the_default_budget() -> None:
    """docs/quality.md states it: at an error correlation of 0.5, 80 % of such challengers pass within ten
    nights of 200 labels (40 drawn at random), half within about seven."""
    better = Loop(champion_accuracy=0.85, challenger_accuracy=0.90, correlation=0.5)
    nights = [passes_within(better, 10, seed) for seed in range(40)]
    rate = np.mean([n is not None for n in nights])
    assert rate >= 0.8 - 3 * math.sqrt(0.8 * 0.2 / 40), f"passed within ten nights in {rate:.0%} of trials"


def _photos(root: str, night: str, n: int) -> list[tuple[str, str]]:
    """``n`` photo files of ``night`` as a listing gives them: (URI, ETag)."""
    folder = storage.join(root, "incoming", f"dt={night}")
    for i in range(n):
        storage.write_bytes_atomic(storage.join(folder, f"{i:03d}.jpg"), f"photo {night} {i}".encode())
    return [(o.uri, o.etag) for o in storage.list_objects(folder)]


def _queue_and_label(root: str, night: str, photos: list[tuple[str, str]], tmp_path: Path) -> queue.QueueResult:
    """The night served by v1 (wrong on photos of odd number) and shadowed by v2 (right on all), queued
    with the default random share, the queue's CSV labelled whole and imported."""
    digits = [str(i) for i in range(10)]
    truth = {uri: i % 10 for i, (uri, _) in enumerate(photos)}
    served = [(uri, etag, (truth[uri] + i % 2) % 10, 0.6 + 0.3 * (i % 2 == 0)) for i, (uri, etag) in enumerate(photos)]
    shadow = [(uri, etag, truth[uri], 0.9) for uri, etag in photos]
    commit_night(root, night, 1, served, model="digits", classes=digits)
    commit_night(root, night, 2, shadow, table_name=layout.SHADOW_TABLE, model="digits", classes=digits)
    queued = queue.run(queue.QueueConfig(root=root, model_name="digits", dt=night, budget=50))
    rows = list(csv.DictReader(io.StringIO(storage.read_bytes(queued.csv_uri).decode())))
    labelled = tmp_path / f"labels-{night}.csv"
    labelled.write_text("uri,etag,label\n" + "".join(f"{r['uri']},{r['etag']},{truth[r['uri']]}\n" for r in rows))
    config = labels_import.LabelsImportConfig(
        file_uri=str(labelled), root=root, model_name="digits", classes=digits, key_base=root
    )
    assert labels_import.run(config).imported == len(rows)
    return queued


def test_labels_a_version_was_trained_on_never_judge_it_and_targeted_labels_are_left_out(
    local_storage: str, tmp_path: Path
) -> None:
    weights = state_dict_bytes(build_model(ModelSpec(width=4)))
    spec = {"model_spec": ModelSpec(width=4), "image_spec": {"crop": 32}, "metrics": {}, "code_version": "test"}
    champion = registry.register("digits", weights, classes=[str(i) for i in range(10)], **spec)  # type: ignore[arg-type]
    first = _queue_and_label(local_storage, "2026-12-01", _photos(local_storage, "2026-12-01", 200), tmp_path)
    assert first.drawn == 10 and sum(q.selection == "random" for q in first.queued) == 10
    # the challenger fine-tuned on the labels so far: the export of the user's path names what it learned
    exported = training_set.run(training_set.ExportConfig(root=local_storage, model_name="digits"))
    learned = registry.TrainingLabels(labels_version=exported.labels_version, import_ids=exported.import_ids)
    parent = registry.ParentModel(name="digits", version=champion.version, uri=champion.uri)
    challenger = registry.register(
        "digits",
        weights,
        classes=[str(i) for i in range(10)],
        parent=parent,
        trained_on_labels=learned,
        **spec,  # type: ignore[arg-type]
    )
    judged = reading.labelled_gate(local_storage, "digits", champion.version, challenger.version)
    assert judged.outcome == "inconclusive" and judged.paired == 0
    assert (judged.targeted, judged.trained_on) == (40, 10)
    assert "0 labels chosen at random" in judged.describe() and "10 trained on" in judged.describe()
    # the next night's draw counts: the challenger wins where the champion was wrong (photos of odd number)
    second = _queue_and_label(local_storage, "2026-12-02", _photos(local_storage, "2026-12-02", 200), tmp_path)
    odd = sum(int(q.uri[-7:-4]) % 2 for q in second.queued if q.selection == "random")
    judged = reading.labelled_gate(local_storage, "digits", champion.version, challenger.version)
    assert (judged.paired, judged.trained_on, judged.targeted) == (10, 10, 80)
    assert (judged.challenger_wins, judged.champion_wins) == (odd, 0)


def test_the_queue_draws_its_random_share_reproducibly_and_records_how_each_photo_was_chosen(
    local_storage: str,
) -> None:
    photos = _photos(local_storage, "2026-12-01", 300)
    commit_night(local_storage, "2026-12-01", 1, [(u, e, 0, 0.5) for u, e in photos], classes=["cat"])
    small = queue.run(queue.QueueConfig(root=local_storage, model_name="pets", dt="2026-12-01", budget=50))
    large = queue.run(queue.QueueConfig(root=local_storage, model_name="pets", dt="2026-12-01", budget=100))
    drawn = {
        1: [q for q in small.queued if q.selection == "random"],
        2: [q for q in large.queued if q.selection == "random"],
    }
    assert (len(drawn[1]), len(drawn[2])) == (10, 20)
    assert {q.uri for q in drawn[1]} <= {q.uri for q in drawn[2]}, "a larger budget draws a longer prefix"
    assert all(q.inclusion_probability == pytest.approx(20 / 300) for q in drawn[2])
    assert all(q.inclusion_probability == 1.0 for q in large.queued if q.selection == "targeted")
    positions = [i for i, q in enumerate(large.queued) if q.selection == "random"]
    assert positions[0] < 10 and positions[-1] > 85, "spread over the queue, not left at its end"
    records = queue.recorded_draws(local_storage, "pets")
    assert sorted(len(d.photos) for d in records) == [10, 20]
    rows = list(csv.DictReader(io.StringIO(storage.read_bytes(large.csv_uri).decode())))
    assert [r["selection"] for r in rows] == [q.selection for q in large.queued]
    tasks = json.loads(storage.read_bytes(large.label_studio_uri))
    assert tasks[positions[0]]["data"]["selection"] == "random"


def test_the_gate_reads_only_the_nights_the_challenger_predicted_found_from_the_files_statistics(
    local_storage: str,
) -> None:
    """Every night's file records its version's range in the Delta log, so the nights of a version are known
    without opening a data file, by the gate and by any reader that skips files by statistics."""
    photos = [(f"s3://photos/{i}.jpg", f"e{i}", 0, 0.9) for i in range(4)]
    for day, served, shadowed in (("2026-12-01", 1, None), ("2026-12-02", 1, 2), ("2026-12-03", 2, 3)):
        commit_night(local_storage, day, served, photos, classes=["cat"])
        if shadowed is not None:
            commit_night(local_storage, day, shadowed, photos, table_name=layout.SHADOW_TABLE, classes=["cat"])
    predictions, shadow = (layout.table_uri(local_storage, t) for t in (layout.PREDICTIONS_TABLE, layout.SHADOW_TABLE))
    assert prediction_reads.nights_of_version(shadow, "pets", 2) == ["2026-12-02"]
    assert prediction_reads.nights_of_version(predictions, "pets", 2) == ["2026-12-03"]
    assert prediction_reads.nights_of_version(predictions, "pets", 1) == ["2026-12-01", "2026-12-02"]
    assert prediction_reads.nights_of_version(predictions, "other", 1) == []
