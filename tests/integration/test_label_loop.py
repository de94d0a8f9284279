"""Choosing what to label, and training on what came back: the queue of a night, its labels imported from
the queue's own CSV, rayline.labels.arrived asking for a retraining, and the champion fine-tuned on the
labelled photos with lineage back to the import."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rayline.flows.import_labels as import_labels_flow
from rayline import events, lineage, storage
from rayline.errors import QualityGateFailed, TransientStorageError
from rayline.flows.import_labels import LabelsImportRequest, import_labels
from rayline.flows.queue_labels import LabelQueueRequest, queue_labels
from rayline.flows.serve_rollout import RolloutRequest, serve_rollout
from rayline.flows.train_model import train_model
from rayline.lineage.graph import LineageNode, build_graph
from rayline.models import registry, split_answers
from rayline.ray_workloads.quality import training_set
from rayline.ray_workloads.training.request import TrainRequest
from rayline.seed import seed_incoming
from rayline.storage import layout, manifests
from rayline.tables import labels as labels_table
from rayline.tables import predictions_table
from rayline.tables.delta_tables import Night
from rayline.tasks.labels import import_labels_task
from tests.integration.helpers import one_stored_event, register_untrained
from tests.unit.test_quality import commit_night
from tests.unit.test_quality_gates import champion_right_answers, plant_paired_night, worse_but_alike

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

DAY = "2026-11-30"
DIGITS = [str(i) for i in range(10)]


def _planted_night(root: str) -> dict[str, tuple[str, int]]:
    """A committed night of the digits, v1 right on 70 %, and v2 in its shadow disagreeing on every 5th photo;
    each photo's (ETag, true class) by URI."""
    incoming = storage.join(root, "incoming", f"dt={DAY}")
    seed_incoming(incoming, corrupt=0)
    digits = [o for o in storage.list_objects(incoming) if "/digit-" in o.key]
    truth = {o.uri: (o.etag, int(o.key.split("/")[0])) for o in digits}
    rng = np.random.default_rng(5)
    served, shadow = [], []
    for i, (uri, (etag, label)) in enumerate(sorted(truth.items())):
        predicted = label if rng.random() < 0.7 else (label + 1) % 10
        served.append((uri, etag, predicted, float(rng.uniform(0.3, 1.0))))
        shadow.append((uri, etag, (predicted + 1) % 10 if i % 5 == 0 else predicted, 0.8))
    commit_night(root, DAY, 1, served, model="digits", classes=DIGITS)
    errors = layout.table_uri(root, layout.ERRORS_TABLE)  # none: every photo decoded
    predictions_table.commit_night(errors, [], Night("digits", DAY), f"run-{DAY}-v1", predictions_table.ERRORS_SCHEMA)
    commit_night(root, DAY, 2, shadow, table_name=layout.SHADOW_TABLE, model="digits", classes=DIGITS)
    return truth


def _read_after_the_append_fails_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The labels table's read back of an import, right after its append, fails transiently once; the import
    task retries at once. Returns the version that read found, once it failed."""
    read_back, failed = labels_table.imported_version, []

    def fails_once_committed(*args: Any) -> int | None:
        found = read_back(*args)
        if found is not None and not failed:
            failed.append(found)
            raise TransientStorageError("injected: the read after the append was reset")
        return found

    monkeypatch.setattr(labels_table, "imported_version", fails_once_committed)
    at_once = import_labels_task.with_options(retry_delay_seconds=0, retry_jitter_factor=None)
    monkeypatch.setattr(import_labels_flow, "import_labels_task", at_once)
    return failed


def _stages(node: LineageNode) -> set[tuple[str | None, str]]:
    found = {(node.stage, node.uri)}
    for parent in node.upstream:
        found |= _stages(parent)
    return found


def test_a_queue_labelled_and_imported_retrains_the_champion_on_its_labelled_photos(
    local_storage: str, prefect_api: str, monkeypatch: pytest.MonkeyPatch, test_started: float
) -> None:
    champion = register_untrained(trained_here=False)
    registry.set_alias("digits", registry.CHAMPION, champion.version, "test")
    truth = _planted_night(local_storage)
    monkeypatch.setenv("RAYLINE_RETRAIN_MIN_NEW_LABELS", "200")

    queued = queue_labels(LabelQueueRequest(night=DAY, budget=40))
    assert len(queued.queued) == 40 and queued.candidates == len(truth) and queued.shadowed
    assert queued.drawn == 8 and sum(q.selection == "random" for q in queued.queued) == 8  # the default 20 %
    priorities = [q.priority for q in queued.queued if q.selection == "targeted"]
    assert priorities == sorted(priorities, reverse=True)
    assert sum(q.disagreement for q in queued.queued) > 40 * 0.2, "disputed photos rank high"
    tasks: list[dict[str, Any]] = json.loads(storage.read_bytes(queued.label_studio_uri))
    assert [t["data"]["image"] for t in tasks] == [q.uri for q in queued.queued]
    assert tasks[0]["predictions"][0]["result"][0]["value"]["choices"] == [queued.queued[0].predicted_class]

    # the queue's CSV, its label column filled in, plus every 6th photo: labels for all ten classes
    rows = list(csv.DictReader(io.StringIO(storage.read_bytes(queued.csv_uri).decode())))
    for row in rows:
        row["label"] = str(truth[row["uri"]][1])
    extra = [u for i, u in enumerate(sorted(truth)) if i % 6 == 0 and u not in {r["uri"] for r in rows}]
    rows += [{"uri": u, "etag": truth[u][0], "label": str(truth[u][1])} for u in extra]
    labels_file = storage.join(local_storage, "labels-back.csv")
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["uri", "etag", "label"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    storage.write_bytes_atomic(labels_file, out.getvalue().encode())
    read_back_failed = _read_after_the_append_fails_once(monkeypatch)
    imported = import_labels(
        LabelsImportRequest(file=labels_file)
    )  # its first attempt commits, then its read back fails: retried
    assert read_back_failed and imported.imported == len(rows) > 200 and not imported.rejected
    assert imported.labels_version == read_back_failed[0] and not imported.already_imported
    later = import_labels(LabelsImportRequest(file=labels_file))  # a run of its own: nothing added, nothing announced
    assert later.already_imported and later.imported == 0

    arrived = one_stored_event(prefect_api, events.LABELS_ARRIVED, "rayline.labels.digits", since=test_started)
    assert arrived["resource"][events.RETRAIN_LABEL] == "true" and arrived["payload"]["pending"] == len(rows)
    assert [r.outputs[0].facets["rows"] for r in lineage.read_records("import-labels")] == [len(rows)]
    again = queue_labels(LabelQueueRequest(night=DAY, budget=40))
    assert again.already_labelled == len(rows)
    assert not {q.uri for q in again.queued} & {r["uri"] for r in rows}, "labelled photos are not queued again"

    # what the retrain deployment runs on that event: the champion fine-tuned on the labelled photos
    result = train_model(TrainRequest(model_name="digits", labelled=True, epochs=1, num_workers=1, floor=0.0))
    version = result.registration.version
    exported = training_set.committed_export(local_storage, "digits")
    assert exported is not None and len(exported.copies) == len(rows)
    folder = manifests.files_folder(
        manifests.manifest_uri(training_set.labelled_folder(local_storage, "digits")), exported
    )
    assert version.parent is not None and version.parent.version == 1
    assert version.trained_on_labels is not None and version.trained_on_labels.import_ids == [imported.import_id]
    assert result.data.ingest.source_uri == folder and result.data.ingest.object_count == len(rows)
    assert training_set.pending_labels(local_storage, "digits") == 0
    # judged image by image against the champion, which had never answered these photos: evaluated on them
    # once, its answers kept with it for the next candidate on the same split
    decision, answers_uri = result.registration.decision, result.evaluation.answers_uri
    assert decision.champion == champion.version and decision.images == result.evaluation.samples
    assert answers_uri is not None
    digest = split_answers.split_digest(storage.read_parquet([answers_uri]))
    kept = split_answers.read(champion.uri, digest)
    assert kept is not None and kept.num_rows == result.evaluation.samples
    stages = _stages(build_graph(version.uri))
    assert ("export-labelled", folder) in stages
    assert ("import-labels", layout.table_uri(local_storage, layout.LABELS_TABLE)) in stages


def test_a_rollout_that_requires_a_labelled_win_waits_for_labels_and_refuses_a_worse_candidate(
    local_storage: str, tmp_path: Path
) -> None:
    champion = register_untrained(trained_here=False)
    registry.set_alias("digits", registry.CHAMPION, champion.version, "test")
    candidate = register_untrained(seed=1, trained_here=False)
    waiting = serve_rollout(RolloutRequest(candidate=f"v{candidate.version}", require_labelled_win=True))
    assert not waiting.promoted and not waiting.steps and "waits for more labels" in waiting.reason
    assert waiting.labelled is not None and waiting.labelled.paired == 0
    assert registry.alias_version("digits", registry.CHAMPION) == champion.version

    champion_right = champion_right_answers()
    plant_paired_night(local_storage, tmp_path, champion_right, worse_but_alike(champion_right))
    with pytest.raises(QualityGateFailed, match=r"digits v2 is not rolled out: failed"):
        serve_rollout(RolloutRequest(candidate=f"v{candidate.version}", require_labelled_win=True))
    assert registry.alias_version("digits", registry.CHAMPION) == champion.version
