"""What the labels say now: each version's figures per night, served and shadowed, and the paired test.

A version's rows come from ``predictions`` (the nights it served) and ``shadow_predictions`` (the nights it
was scored beside the champion); a night whose shadow rows are some version's and whose served rows another's
gives each its figures. The paired test takes every labelled photo both versions predicted, in either table,
at its newest night: of every night for the promotion gates, of the nights it reports for the monitor.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from rayline.ray_workloads.quality import metrics
from rayline.ray_workloads.quality.paired import PairedTest, PairedTestPolicy, paired_test
from rayline.storage.layout import PREDICTIONS_TABLE, SHADOW_TABLE
from rayline.tables.labels import read_labels
from rayline.tables.prediction_reads import committed_nights

TABLES = (PREDICTIONS_TABLE, SHADOW_TABLE)


def labelled_rows(root: str, model_name: str, nights: Sequence[str] | None = None) -> dict[str, pa.Table]:
    """Each table's labelled predictions of ``model_name`` (:func:`metrics.labelled_predictions`), of ``nights``
    only when given."""
    labels = read_labels(root, model_name)
    return {table: metrics.labelled_predictions(root, model_name, labels, table, nights) for table in TABLES}


def version_rows(rows: dict[str, pa.Table], version: int) -> pa.Table:
    """One version's labelled predictions, served and shadowed together."""
    return pa.concat_tables([joined.filter(pc.field("model_version") == version) for joined in rows.values()])


def compare_versions(
    rows: dict[str, pa.Table], champion: int, challenger: int, policy: PairedTestPolicy | None = None
) -> PairedTest:
    """The paired test of ``challenger`` against ``champion`` on every labelled photo both predicted."""
    return paired_test(version_rows(rows, champion), version_rows(rows, challenger), champion, challenger, policy)


def labelled_gate(root: str, model_name: str, champion: int, challenger: int) -> PairedTest:
    """The promotion gates' question: does ``challenger`` beat ``champion`` on the labels (served and shadow
    nights alike)? Passed, failed, or inconclusive: then it waits for more labels."""
    return compare_versions(labelled_rows(root, model_name), champion, challenger)


def labelled_reading(
    root: str, model_name: str, classes: list[str], nights: int, champion: int, challenger: int | None
) -> metrics.QualityReading:
    """Each version's labelled figures on those of the latest ``nights`` committed nights that have labels
    (oldest first, served and shadowed), and the paired test of ``challenger`` against ``champion`` on them.

    Only those nights' partitions are read: what a monitor run reads stays the same as nights accumulate.
    """
    rows = labelled_rows(root, model_name, committed_nights(root, model_name, latest=nights))
    found = [q for table, joined in rows.items() for q in metrics.night_quality(joined, model_name, classes, table)]
    found.sort(key=lambda q: (q.dt, q.model_version, q.table))
    test = None
    if challenger is not None and challenger != champion:
        test = compare_versions(rows, champion, challenger)
    return metrics.QualityReading(nights=found, paired=test)
