"""Labels come back and are joined to the nights: the import's checks, the quality figures, the paired test."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayline import storage
from rayline.errors import InputDataError, TransientStorageError
from rayline.ray_workloads.quality import labels_import, metrics, paired
from rayline.storage import layout
from rayline.tables import delta_tables, predictions_table
from rayline.tables import labels as labels_table
from rayline.tables.labels import read_labels

pytestmark = pytest.mark.unit

CLASSES = ["cat", "dog", "fox"]
MODEL = "pets"


def commit_night(
    root: str,
    dt: str,
    version: int,
    photos: list[tuple[str, str, int, float]],
    *,
    table_name: str = layout.PREDICTIONS_TABLE,
    model: str = MODEL,
    classes: list[str] = CLASSES,
) -> None:
    """A committed night of ``photos`` (uri, etag, predicted index, confidence) predicted by ``version``, in
    ``table_name`` (predictions, or shadow_predictions for a version scored in the night's shadow)."""
    n = len(photos)
    rows = pa.table(
        {
            "uri": [p[0] for p in photos],
            "etag": [p[1] for p in photos],
            "predicted_index": [p[2] for p in photos],
            "predicted_class": [classes[p[2]] for p in photos],
            "confidence": pa.array([p[3] for p in photos], pa.float32()),
            "top_k_index": [[p[2]] for p in photos],
            "top_k_prob": [[p[3]] for p in photos],
            "top_k_class": [[classes[p[2]]] for p in photos],
            "inference_ms": pa.array([1.0] * n, pa.float32()),
            "model_version": [version] * n,
            "code_version": ["test"] * n,
            "flow_run_id": ["run"] * n,
            "plan": ["eager/fp32"] * n,
        },
        schema=predictions_table.PREDICTIONS_SCHEMA,
    )
    table = layout.table_uri(root, table_name)
    night = delta_tables.Night(model, dt)
    run_id = f"run-{dt}-v{version}"
    files = [predictions_table.write_data_file(table, night, run_id, 0, rows)]
    predictions_table.commit_night(table, files, night, run_id, predictions_table.PREDICTIONS_SCHEMA)


def _photo(i: int) -> str:
    return f"s3://photos/incoming/dt=2026-12-01/img-{i:03d}.jpg"


def _config(root: str, path: Path) -> labels_import.LabelsImportConfig:
    return labels_import.LabelsImportConfig(
        file_uri=str(path),
        root=root,
        model_name=MODEL,
        classes=CLASSES,
        key_base="s3://photos/incoming",
        source="team-a",
    )


@pytest.fixture
def night(tmp_path: Path) -> str:
    """A root with one night of 6 photos predicted by v1: img-000..005, ETag e<i>, class i % 3."""
    root = str(tmp_path / "storage")
    commit_night(root, "2026-12-01", 1, [(_photo(i), f"e{i}", i % 3, 0.9) for i in range(6)])
    return root


def test_a_labels_file_is_appended_once_and_every_refusal_is_reported_by_reason(night: str, tmp_path: Path) -> None:
    path = tmp_path / "labels.csv"
    path.write_text(
        "uri,etag,label,labelled_at\n"
        f"{_photo(0)},e0,cat,2026-12-02T09:00:00Z\n"  # right
        f"{_photo(1)},,dog,\n"  # no ETag: the newest predicted one
        f"{_photo(2)},old-etag,fox,\n"  # stale
        "s3://photos/incoming/dt=2026-12-01/never-seen.jpg,,cat,\n"  # unknown photo
        f"{_photo(3)},e3,wolf,\n"  # not a class of the model
        f"{_photo(4)},e4,,\n"  # no label
        f"{_photo(5)},e5,2,yesterday\n"  # by index, but a bad time
    )
    result = labels_import.run(_config(night, path))

    assert result.rows_read == 7 and result.imported == 2 and result.rejected_total == 5
    assert result.rejected == {
        "bad_labelled_at": 1,
        "missing_label": 1,
        "stale_etag": 1,
        "unknown_class": 1,
        "unknown_uri": 1,
    }
    refused = list(csv.DictReader(io.StringIO(storage.read_bytes(str(result.rejected_uri)).decode())))
    assert {r["row"]: r["reason"] for r in refused} == {
        "3": "stale_etag",
        "4": "unknown_uri",
        "5": "unknown_class",
        "6": "missing_label",
        "7": "bad_labelled_at",
    }
    assert "old-etag" in refused[0]["detail"] and "e2" in refused[0]["detail"]
    labels = read_labels(night, MODEL)
    assert labels.select(["uri", "etag", "label", "label_index", "source"]).to_pylist() == [
        {"uri": _photo(0), "etag": "e0", "label": "cat", "label_index": 0, "source": "team-a"},
        {"uri": _photo(1), "etag": "e1", "label": "dog", "label_index": 1, "source": "team-a"},
    ]
    assert [d.uri for d in result.lineage_outputs()] == [result.labels_table_uri]

    again = labels_import.run(_config(night, path))
    assert again.already_imported and again.imported == 0 and again.labels_version == result.labels_version
    assert read_labels(night, MODEL).num_rows == 2


def test_a_retry_in_the_same_run_reports_what_its_first_attempt_committed_and_a_later_run_reports_nothing_added(
    night: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "labels.csv"
    path.write_text(f"uri,label\n{_photo(0)},cat\n{_photo(1)},dog\n{_photo(2)},wolf\n")
    read_back, failed = labels_table.imported_version, []

    def fails_once_once_committed(*args: Any) -> int | None:
        found = read_back(*args)
        if found is not None and not failed:  # the read after the append: the table holds the import now
            failed.append(found)
            raise TransientStorageError("injected: the read after the append was reset")
        return found

    monkeypatch.setattr(labels_table, "imported_version", fails_once_once_committed)
    in_run = _config(night, path).model_copy(update={"run_id": "flow-run-1"})
    with pytest.raises(TransientStorageError):
        labels_import.run(in_run)
    assert failed, "the append landed before its read back failed"

    retried = labels_import.run(in_run)
    assert (retried.imported, retried.already_imported, retried.rejected) == (2, False, {"unknown_class": 1})
    assert retried.labels_version == failed[0] and retried.rejected_uri is not None
    assert [d.uri for d in retried.lineage_outputs()] == [retried.labels_table_uri]

    later = labels_import.run(_config(night, path).model_copy(update={"run_id": "flow-run-2"}))
    assert (later.imported, later.already_imported, later.labels_version) == (0, True, failed[0])
    assert read_labels(night, MODEL).num_rows == 2


def test_a_label_that_is_neither_a_class_name_nor_an_ascii_index_is_refused_naming_its_row(
    night: str, tmp_path: Path
) -> None:
    """``"²".isdigit()`` is True and ``int("²")`` raises; ``int("１")`` (full width) is 1: none is an index."""
    path = tmp_path / "labels.csv"
    path.write_text(f"uri,label\n{_photo(0)},²\n{_photo(1)},１\n{_photo(2)},٢\n{_photo(3)},0\n", encoding="utf-8")
    result = labels_import.run(_config(night, path))
    assert result.imported == 1 and result.rejected == {"unknown_class": 3}
    refused = list(csv.DictReader(io.StringIO(storage.read_bytes(str(result.rejected_uri)).decode())))
    assert [(r["row"], r["label"], r["reason"]) for r in refused] == [
        ("1", "²", "unknown_class"),
        ("2", "１", "unknown_class"),
        ("3", "٢", "unknown_class"),
    ]
    assert "an index 0-2" in refused[0]["detail"]
    assert read_labels(night, MODEL).select(["uri", "label"]).to_pylist() == [{"uri": _photo(3), "label": "cat"}]


def test_keys_parquet_and_json_lines_are_read_and_a_relabel_wins(night: str, tmp_path: Path) -> None:
    parquet = tmp_path / "first.parquet"
    pq.write_table(pa.table({"key": ["dt=2026-12-01/img-000.jpg"], "label": [1]}), parquet)  # an index, as a number
    first = labels_import.run(_config(night, parquet))
    assert first.imported == 1 and first.rejected == {}

    lines = tmp_path / "second.jsonl"
    rows = [
        {"uri": _photo(0), "label": "fox", "labelled_at": "2030-01-01T00:00:00Z"},
        {"uri": _photo(1), "label": "dog"},
    ]
    lines.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    second = labels_import.run(_config(night, lines))
    assert second.imported == 2

    newest = {r["uri"]: r["label"] for r in read_labels(night, MODEL).to_pylist()}
    assert newest == {_photo(0): "fox", _photo(1): "dog"}  # the later label of img-000 wins

    same_again = tmp_path / "third.jsonl"
    same_again.write_text(json.dumps({"uri": _photo(1), "label": "dog", "source": "team-b"}) + "\n")
    third = labels_import.run(_config(night, same_again))
    assert (third.imported, third.already_labelled) == (0, 1)


def test_one_photo_labelled_two_ways_in_one_file_is_refused_as_conflicting(night: str, tmp_path: Path) -> None:
    path = tmp_path / "labels.csv"
    path.write_text(f"uri,label\n{_photo(0)},cat\n{_photo(0)},dog\n{_photo(1)},dog\n{_photo(1)},dog\n")
    result = labels_import.run(_config(night, path))
    assert result.rejected == {"conflicting": 1} and result.imported == 1


@pytest.mark.parametrize(
    ("name", "body", "expected"),
    [
        ("labels.txt", "uri,label\n", "CSV, Parquet or JSON Lines"),
        ("labels.csv", "path,class\nx,y\n", "needs 'label' and 'uri' or 'key'"),
        ("labels.csv", "uri,label\n", "holds no labels"),
    ],
)
def test_an_unusable_labels_file_is_refused_before_anything_is_written(
    night: str, tmp_path: Path, name: str, body: str, expected: str
) -> None:
    path = tmp_path / name
    path.write_text(body)
    with pytest.raises(InputDataError, match=expected):
        labels_import.run(_config(night, path))
    assert read_labels(night, MODEL).num_rows == 0


def test_quality_per_version_and_night_joins_labels_on_uri_and_etag(tmp_path: Path) -> None:
    root = str(tmp_path / "storage")
    # night 1 by v1: photos 0-9 all predicted class 0 at 0.9; night 2 by v2: photos 0-9 right at 0.6
    truth = [i % 3 for i in range(10)]
    commit_night(root, "2026-12-01", 1, [(_photo(i), f"e{i}", 0, 0.9) for i in range(10)])
    commit_night(root, "2026-12-02", 2, [(_photo(i), f"e{i}", truth[i], 0.6) for i in range(10)])
    commit_night(root, "2026-12-03", 2, [(_photo(i), f"new-e{i}", 0, 0.6) for i in range(10)])  # re-uploaded
    labels = tmp_path / "labels.csv"
    labels.write_text("uri,etag,label\n" + "".join(f"{_photo(i)},e{i},{truth[i]}\n" for i in range(10)))
    cfg = _config(root, labels)
    # the photos' newest ETags are the re-uploads: labels of the old files are stale, so import them as of night 2
    assert labels_import.run(cfg).rejected == {"stale_etag": 10}
    table = labels_import.newest_predicted_etags(root, MODEL, [_photo(0)])
    assert table[0] == {_photo(0): "new-e0"}

    labelled = pa.table(
        {"uri": [_photo(i) for i in range(10)], "etag": [f"e{i}" for i in range(10)], "label_index": truth}
    )
    joined = metrics.labelled_predictions(root, MODEL, labelled)
    nights = metrics.night_quality(joined, MODEL, CLASSES)
    assert [(n.model_version, n.dt, n.labelled) for n in nights] == [(1, "2026-12-01", 10), (2, "2026-12-02", 10)]
    v1, v2 = nights
    assert v1.accuracy == pytest.approx(0.4) and v1.recall == {"cat": 1.0, "dog": 0.0, "fox": 0.0}
    assert v1.ece == pytest.approx(0.5)  # 90 % sure, 40 % right
    assert v2.accuracy == 1.0 and v2.ece == pytest.approx(0.4)
    assert metrics.version_quality(joined, CLASSES)[2].labelled == 10


def test_ece_is_zero_when_confidence_is_accuracy() -> None:
    confidence = np.array([0.75] * 4 + [0.25] * 4)
    correct = np.array([True, True, True, False, True, False, False, False])
    assert metrics.expected_calibration_error(confidence, correct) == pytest.approx(0.0)


def _versions(truth: np.ndarray, right: np.ndarray, version: int, wrong_as: int = 1) -> pa.Table:
    predicted = np.where(right, truth, (truth + wrong_as) % 10)
    n = truth.size
    return pa.table(
        {
            "uri": [_photo(i) for i in range(n)],
            "etag": ["e"] * n,
            "dt": ["2026-12-01"] * n,
            "predicted_index": predicted,
            "label_index": truth,
            "model_version": [version] * n,
        }
    )


def test_the_paired_test_passes_a_better_challenger_and_fails_one_that_agrees_more_but_is_worse() -> None:
    rng = np.random.default_rng(7)
    n = 400
    truth = rng.integers(0, 10, n)
    champion_right = rng.random(n) < 0.85
    champion = _versions(truth, champion_right, 1)
    # better but less alike: fixes 40 of the champion's mistakes, breaks 8 of its right answers elsewhere
    fixes = np.flatnonzero(~champion_right)[:40]
    breaks = np.flatnonzero(champion_right)[:8]
    better_right = champion_right.copy()
    better_right[fixes], better_right[breaks] = True, False
    better = paired.paired_test(champion, _versions(truth, better_right, 2, wrong_as=2), 1, 2)
    # alike on 97 % but worse: keeps the champion's answers but breaks 12 right ones
    worse_right = champion_right.copy()
    worse_right[np.flatnonzero(champion_right)[:12]] = False
    worse = paired.paired_test(champion, _versions(truth, worse_right, 3), 1, 3)

    assert better.outcome == "passed" and (better.challenger_wins, better.champion_wins) == (40, 8)
    assert worse.outcome == "failed" and (worse.challenger_wins, worse.champion_wins) == (0, 12)
    assert worse.agreement is not None and better.agreement is not None and worse.agreement > better.agreement
    assert better.challenger_accuracy is not None and better.champion_accuracy is not None
    assert better.challenger_accuracy > better.champion_accuracy


def test_few_discordant_labels_are_inconclusive_and_photos_only_one_version_predicted_are_not_paired() -> None:
    truth = np.arange(20) % 10
    champion = _versions(truth, np.ones(20, bool), 1)
    challenger_right = np.ones(20, bool)
    challenger_right[:2] = False
    challenger = _versions(truth, challenger_right, 2).slice(0, 10)
    result = paired.paired_test(champion, challenger, 1, 2)
    assert result.outcome == "inconclusive" and result.paired == 10 and result.champion_wins == 2
    nothing = paired.paired_test(champion, challenger.slice(0, 0), 1, 2)
    assert nothing.outcome == "inconclusive" and nothing.paired == 0
    assert "0 labels chosen at random" in nothing.describe()


def test_looking_after_every_label_passes_a_no_better_challenger_at_most_alpha_over_one_minus_beta() -> None:
    """A coin-flip challenger, tested after each of 300 discordant labels, in 4,000 simulated histories."""
    policy = paired.PairedTestPolicy()
    rng = np.random.default_rng(11)
    wins = np.cumsum(rng.random((4000, 300)) < 0.5, axis=1)
    losses = np.arange(1, 301) - wins
    llr = wins * np.log(policy.p_better / 0.5) + losses * np.log((1 - policy.p_better) / 0.5)
    ever_passed = (llr >= policy.upper).any(axis=1)
    assert ever_passed.mean() <= policy.alpha / (1 - policy.beta)
    assert paired.sprt(int(wins[0, -1]), int(losses[0, -1]), policy)[1] == pytest.approx(llr[0, -1])
