"""Quality reads bounded by what they report: a shadowed night's figures summed block by block, and the
monitor's labelled reading confined to the nights it reports."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rayline.errors import StorageError
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.nightly.blocks import BlockReport, reports_batch, reports_of
from rayline.ray_workloads.nightly.compaction import NightTotals
from rayline.ray_workloads.quality import labels_import, metrics, reading
from rayline.ray_workloads.quality.shadow import ShadowCounts, block_counts, class_shift, exact_units, summarize
from rayline.storage import layout
from rayline.storage.digests import SetDigest
from rayline.tables.delta_tables import open_table
from rayline.tables.labels import read_labels
from rayline.tables.predictions_table import PREDICTIONS_SCHEMA
from tests.unit.test_quality import commit_night

pytestmark = pytest.mark.unit

CLASSES = ["cat", "dog", "fox"]
SHADOW_TABLE = "/t/shadow_predictions"


def _rows(photos: list[tuple[str, int, float]], version: int) -> pa.Table:
    """A block file's rows: (uri, predicted index, confidence) each, the other columns as the predictor fills them."""
    n = len(photos)
    return pa.table(
        {
            "uri": [p[0] for p in photos],
            "etag": ["e"] * n,
            "predicted_index": [p[1] for p in photos],
            "predicted_class": [CLASSES[p[1]] for p in photos],
            "confidence": pa.array([p[2] for p in photos], pa.float32()),
            "top_k_index": [[p[1]] for p in photos],
            "top_k_prob": [[p[2]] for p in photos],
            "top_k_class": [[CLASSES[p[1]]] for p in photos],
            "inference_ms": pa.array([1.0] * n, pa.float32()),
            "model_version": [version] * n,
            "code_version": ["test"] * n,
            "flow_run_id": [""] * n,
            "plan": ["eager/fp32"] * n,
        },
        schema=PREDICTIONS_SCHEMA,
    )


def _blocks() -> list[tuple[pa.Table, pa.Table]]:
    """Three blocks of a shadowed night: (the champion's predictions, the shadow's rows) each.

    The second block has images the shadow failed on (no shadow row) and one the champion failed on that the
    shadow scored; the third block's shadow failed on every image. Confidences include a tiny and a subnormal
    float32, where a float64 running sum would lose them.
    """
    rng = np.random.default_rng(11)

    def photos(block: int, n: int) -> list[tuple[str, int, float]]:
        return [(f"/in/b{block}/{i:03d}.jpg", int(rng.integers(0, 3)), float(rng.random())) for i in range(n)]

    first, second, third = photos(0, 40), photos(1, 30), photos(2, 12)
    first[0] = (first[0][0], first[0][1], 1e-30)
    first[1] = (first[1][0], first[1][1], 1e-40)  # subnormal in float32
    shadow_first = [(u, (c + (i % 4 == 0)) % 3, float(rng.random())) for i, (u, c, _) in enumerate(first)]
    shadow_second = [(u, c, float(rng.random())) for u, c, _ in second[:20]]  # failed on the last 10
    champion_second = second[:-1]  # the champion failed on the last image; the shadow scored it
    return [
        (_rows(first, 1), _rows(shadow_first, 2)),
        (_rows(champion_second, 1), _rows([*shadow_second, (second[-1][0], 2, 0.5)], 2)),
        (_rows(third, 1), _rows([], 2)),
    ]


def _exact_mean(column: pa.ChunkedArray) -> float:
    values = column.to_numpy()
    return float(sum((Fraction(float(v)) for v in values), Fraction(0)) / len(values))


def _version() -> ModelVersion:
    return ModelVersion.model_validate(
        {
            "name": "pets",
            "version": 2,
            "uri": "/r/pets/v2",
            "weights_uri": "/r/pets/v2/model.pt",
            "model_spec": {"num_classes": 3, "width": 8},
            "image_spec": {"crop": 32},
            "classes": CLASSES,
            "metrics": {},
            "data_manifest_uri": "-",
            "data_content_hash": "-",
            "code_version": "test",
            "registered_at": "2026-12-01T00:00:00+00:00",
        }
    )


def test_a_shadowed_nights_figures_summed_over_its_blocks_equal_the_whole_night_joined() -> None:
    blocks = _blocks()
    champion = pa.concat_tables([p for p, _ in blocks])
    shadowed = pa.concat_tables([s for _, s in blocks])
    inputs = champion.num_rows + 1  # the image the champion failed on is an error row

    # the whole night joined in one place, as a driver holding every row would
    joined = champion.select(["uri", "predicted_class", "confidence"]).join(
        shadowed.select(["uri", "predicted_class", "confidence"]), "uri", right_suffix="_shadow", join_type="inner"
    )
    counts = Counter(joined["predicted_class"].to_pylist())
    shadow_counts = Counter(joined["predicted_class_shadow"].to_pylist())
    same = pc.sum(pc.equal(joined["predicted_class"], joined["predicted_class_shadow"])).as_py()

    summed = ShadowCounts.total(block_counts(p, s) for p, s in blocks)
    committed = SetDigest.of(shadowed["uri"].to_pylist())
    summary = summarize(summed, committed, _version(), SHADOW_TABLE, inputs)
    assert (summary.rows, summary.compared) == (shadowed.num_rows, joined.num_rows) == (61, 60)
    assert summary.agreement == same / joined.num_rows
    assert summary.class_counts == dict(sorted(counts.items()))
    assert summary.shadow_class_counts == dict(sorted(shadow_counts.items()))
    assert summary.class_shift == class_shift(counts, shadow_counts)
    gaps = [abs(counts[c] - shadow_counts[c]) / joined.num_rows for c in CLASSES]
    assert summary.class_shift == pytest.approx(sum(gaps) / 2, abs=1e-15)
    assert summary.mean_confidence == _exact_mean(joined["confidence"])
    assert summary.shadow_mean_confidence == _exact_mean(joined["confidence_shadow"])
    assert summary.mean_confidence == pytest.approx(pc.mean(joined["confidence"]).as_py(), rel=1e-12)

    # the same figures whatever order the blocks' reports arrive in, and through the reports' JSON
    reports = [
        BlockReport(
            f"p0/b{i:09d}", p.num_rows, 0, 0, 0, SetDigest(), shadow=s.num_rows, shadow_counts=block_counts(p, s)
        )
        for i, (p, s) in enumerate(reversed(blocks))
    ]
    totals = NightTotals()
    for row in pa.table(reports_batch(reports)).to_pylist():
        for report in reports_of(row):
            totals.add(report)
    assert summarize(totals.shadow, committed, _version(), SHADOW_TABLE, inputs) == summary


def test_a_shadow_with_more_rows_than_the_nights_inputs_or_other_rows_than_its_files_is_refused() -> None:
    blocks = _blocks()
    summed = ShadowCounts.total(block_counts(p, s) for p, s in blocks)
    shadow_uris = pa.concat_tables([s for _, s in blocks])["uri"].to_pylist()
    with pytest.raises(StorageError, match="more than the night's 60 inputs"):
        summarize(summed, SetDigest.of(shadow_uris), _version(), SHADOW_TABLE, 60)
    with pytest.raises(StorageError, match="block reports name 61 rows.*compacted files 60"):
        summarize(summed, SetDigest.of(shadow_uris[1:]), _version(), SHADOW_TABLE, 100)


def test_exact_sums_of_float32_confidences_do_not_depend_on_their_order() -> None:
    values = np.array([1.0, 1e-8, 3e-39, 0.1, 0.7, 1e-45], dtype=np.float32)
    units, finite = exact_units(values)
    assert finite and Fraction(units, 1 << 149) == sum(Fraction(float(v)) for v in values)
    assert exact_units(values[::-1]) == (units, True)
    assert exact_units(np.array([0.5, np.nan], dtype=np.float32)) == (1 << 148, False)


def _night(i: int) -> str:
    return f"2026-12-0{i}"


def _night_photos(dt: str, n: int = 6) -> list[tuple[str, str, int, float]]:
    return [(f"s3://photos/incoming/dt={dt}/img-{i:03d}.jpg", f"e{i}", i % 3, 0.8) for i in range(n)]


def _label(root: str, tmp_path: Path, nights: list[str]) -> None:
    path = tmp_path / "labels.csv"
    rows = [
        f"{uri},{(index + (i % 2)) % 3}\n" for dt in nights for i, (uri, _, index, _) in enumerate(_night_photos(dt))
    ]
    path.write_text("uri,label\n" + "".join(rows))
    config = labels_import.LabelsImportConfig(  # every photo of those nights: a census, declared random
        file_uri=str(path),
        root=root,
        model_name="pets",
        classes=CLASSES,
        key_base="s3://photos/incoming",
        selection="random",
    )
    assert labels_import.run(config).imported == len(rows)


def _remove_night_files(root: str, table: str, dt: str) -> None:
    """Delete a night's data files under the table's log: any read that opens them fails."""
    tbl = open_table(layout.table_uri(root, table))
    for uri in tbl.file_uris(file_pruning_predicate=[("dt", "=", dt)]):
        Path(uri.removeprefix("file://")).unlink()


def test_the_monitors_labelled_reading_opens_only_the_latest_committed_nights(tmp_path: Path) -> None:
    root = str(tmp_path / "storage")
    nights = [_night(i) for i in range(1, 5)]
    for i, dt in enumerate(nights):  # v1 served every night; v2, a new challenger, scored in the last two's shadow
        commit_night(root, dt, 1, _night_photos(dt))
        if i >= 2:
            commit_night(root, dt, 2, _night_photos(dt), table_name=layout.SHADOW_TABLE)
    _label(root, tmp_path, nights[:3])  # the newest night has no labels yet
    for table in (layout.PREDICTIONS_TABLE, layout.SHADOW_TABLE):
        _remove_night_files(root, table, nights[0])

    # the latest 2 committed nights, those of them with labels: the newest has none, the oldest is not read
    found = reading.labelled_reading(root, "pets", CLASSES, 2, 1, 2)
    assert {(q.dt, q.model_version, q.role) for q in found.nights} == {
        (nights[2], 1, "served"),
        (nights[2], 2, "shadow"),
    }
    assert all(q.labelled == 6 and q.accuracy == pytest.approx(0.5) for q in found.nights)
    assert found.paired is not None and found.paired.paired == 6, "the gate's test, over the challenger's nights"
    # a read of every night opens the removed files, and fails
    with pytest.raises(StorageError):
        metrics.labelled_predictions(root, "pets", read_labels(root, "pets"))
