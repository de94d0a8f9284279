"""What the labels say now: each version's figures per night, served (``predictions``) and shadowed
(``shadow_predictions``), and the paired test the gates and the monitor ask: every labelled photo both
versions predicted, in either table, at its newest night, of the nights the challenger predicted, that the
evidence rule counts (:mod:`rayline.ray_workloads.quality.evidence`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from rayline.ray_workloads.quality import metrics
from rayline.ray_workloads.quality.evidence import gate_evidence, learned_imports
from rayline.ray_workloads.quality.paired import PairedTest, Photo, holds, paired_test
from rayline.storage.layout import PREDICTIONS_TABLE, SHADOW_TABLE, table_uri
from rayline.tables.labels import photos_of_imports, read_labels
from rayline.tables.prediction_reads import committed_nights, nights_of_version

TABLES = (PREDICTIONS_TABLE, SHADOW_TABLE)


def labelled_rows(root: str, model_name: str, nights: Sequence[str] | None = None) -> dict[str, pa.Table]:
    """Each table's labelled predictions of ``model_name`` (of ``nights`` only, when given)."""
    labels = read_labels(root, model_name)
    return {table: metrics.labelled_predictions(root, model_name, labels, table, nights) for table in TABLES}


def version_rows(rows: dict[str, pa.Table], version: int) -> pa.Table:
    """One version's labelled predictions, served and shadowed together."""
    return pa.concat_tables([joined.filter(pc.field("model_version") == version) for joined in rows.values()])


def labelled_gate(root: str, model_name: str, champion: int, challenger: int) -> PairedTest:
    """Does ``challenger`` beat ``champion`` on the random labels neither learned? Passed, failed, or inconclusive."""
    nights = challenger_nights(root, model_name, challenger)
    return _gate(root, model_name, labelled_rows(root, model_name, nights), champion, challenger)


def challenger_nights(root: str, model_name: str, challenger: int) -> list[str]:
    """The nights ``challenger`` predicted, served or shadowed: where every photo it can be judged on is."""
    return sorted({dt for table in TABLES for dt in nights_of_version(table_uri(root, table), model_name, challenger)})


def _gate(root: str, model_name: str, rows: dict[str, pa.Table], champion: int, challenger: int) -> PairedTest:
    """The paired test of ``challenger`` against ``champion`` on ``rows`` that the evidence rule counts."""
    evidence = gate_evidence(root, model_name, [champion, challenger])
    return paired_test(
        version_rows(rows, champion), version_rows(rows, challenger), champion, challenger, None, evidence
    )


def _of_nights(rows: dict[str, pa.Table], nights: list[str]) -> dict[str, pa.Table]:
    wanted = pa.array(nights, pa.string())
    return {table: joined.filter(pc.is_in(joined["dt"], value_set=wanted)) for table, joined in rows.items()}


def labelled_reading(
    root: str, model_name: str, classes: list[str], nights: int, champion: int, challenger: int | None
) -> metrics.QualityReading:
    """Each version's labelled figures on the latest ``nights`` committed nights (oldest first, served and
    shadowed), and the promotion gate's test of ``challenger`` against ``champion`` (:func:`labelled_gate`).

    A version's figures count what the gate counts (photos drawn at random that it did not train on; the rest
    in ``left_out``): an estimate of its accuracy on the night, not on the photos it was unsure of. Only those
    nights' partitions are read, so a monitor run reads the same as nights accumulate.
    """
    reported = committed_nights(root, model_name, latest=nights)
    judged = challenger_nights(root, model_name, challenger) if challenger not in (None, champion) else []
    both = labelled_rows(root, model_name, sorted(set(reported) | set(judged)))  # each night read once
    random = gate_evidence(root, model_name, []).random
    found = []
    for table, joined in _of_nights(both, reported).items():
        counted = _counted_rows(root, model_name, joined, random)
        left_out = Counter(_night_keys(joined)) - Counter(_night_keys(counted))
        found += metrics.night_quality(counted, model_name, classes, table, left_out)
    found.sort(key=lambda q: (q.dt, q.model_version, q.table))
    test = None
    if challenger is not None and challenger != champion:
        test = _gate(root, model_name, _of_nights(both, judged), champion, challenger)
    return metrics.QualityReading(nights=found, paired=test)


def _counted_rows(root: str, model_name: str, joined: pa.Table, random: frozenset[Photo]) -> pa.Table:
    """``joined``'s rows the gate counts: drawn at random, and not learned by the version that predicted them."""
    parts = []
    for version in sorted(set(joined["model_version"].to_pylist())):
        own = joined.filter(pc.field("model_version") == version)
        learned = photos_of_imports(root, model_name, sorted(learned_imports(model_name, version)))
        parts.append(own.filter(pc.and_(holds(own, random), pc.invert(holds(own, learned)))))
    return pa.concat_tables(parts) if parts else joined


def _night_keys(rows: pa.Table) -> list[tuple[int, str]]:
    return list(zip(rows["model_version"].to_pylist(), rows["dt"].to_pylist(), strict=True))
