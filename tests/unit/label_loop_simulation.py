"""A user's label loop, simulated night after night through rayline's own queue and gate.

Each night a champion serves ``photos`` photos and a challenger is scored in its shadow. The champion's
confidence is informative (its top-two margin is smaller where it is wrong), and the two versions' errors are
correlated at ``correlation`` (the phi coefficient of their "wrong" indicators). rayline's queue
(:func:`queue.select`) picks ``budget`` photos with its default random share; people label every queued photo
with its true class; the gate (:func:`paired.paired_test` under :func:`evidence.evidence`) judges the
challenger on all the labels so far, after each night, as the promotion gates ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayline.ray_workloads.quality import evidence, paired, queue
from rayline.ray_workloads.quality.paired import PairedTestPolicy
from rayline.tables import labels as labels_table

CLASSES = 10
FIRST_NIGHT = date(2026, 12, 1)
ETAGS = pa.array([f"e{i}" for i in range(10_000)])
NAMES = pa.array([f"{i:05d}.jpg" for i in range(10_000)])
PREDICTED_SCHEMA = pa.schema(
    [("uri", pa.string()), ("etag", pa.string()), ("dt", pa.string()), ("predicted_index", pa.int64()),
     ("label_index", pa.int64())]
)  # fmt: skip


@dataclass(frozen=True)
class Loop:
    champion_accuracy: float
    challenger_accuracy: float
    correlation: float
    photos: int = 2000
    budget: int = 200
    random_share: float = 0.2  # the queue's default
    targeted_only: bool = False  # the gate counting every label, as it did before the random share


def _outcomes(loop: Loop, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Which photos each version gets right, their errors' phi correlation ``loop.correlation``."""
    qa, qb = 1 - loop.champion_accuracy, 1 - loop.challenger_accuracy
    both = min(qa * qb + loop.correlation * np.sqrt(qa * (1 - qa) * qb * (1 - qb)), qa, qb)  # as close as can be
    cells = np.array([both, qa - both, qb - both, 1 - qa - qb + both])  # wrong/wrong, a wrong, b wrong, right
    drawn = rng.choice(4, size=loop.photos, p=cells)
    return np.isin(drawn, (2, 3)), np.isin(drawn, (1, 3))


def _night(
    loop: Loop, dt: str, rng: np.random.Generator
) -> tuple[pa.Table, pa.Array, np.ndarray, np.ndarray, np.ndarray]:
    """The champion's night (as the predictions table holds it), the shadow's classes, the truth, and each
    version's answers."""
    truth = rng.integers(0, CLASSES, loop.photos)
    right_a, right_b = _outcomes(loop, rng)
    wrong_a = (truth + rng.integers(1, CLASSES, loop.photos)) % CLASSES
    same_mistake = rng.random(loop.photos) < 0.5
    wrong_b = np.where(same_mistake, wrong_a, (truth + rng.integers(1, CLASSES, loop.photos)) % CLASSES)
    answer_a, answer_b = np.where(right_a, truth, wrong_a), np.where(right_b, truth, wrong_b)
    # informative confidence: a wide top-two margin where it is right, a narrow one where it is wrong
    first = np.where(right_a, rng.beta(8, 2, loop.photos), rng.beta(4, 4, loop.photos))
    second = (1 - first) * np.where(right_a, rng.beta(2, 6, loop.photos), rng.beta(6, 2, loop.photos))
    offsets = pa.array(np.arange(0, 2 * loop.photos + 1, 2, dtype=np.int32))
    night = pa.table(
        {
            "uri": pc.binary_join_element_wise(f"s3://photos/incoming/dt={dt}/", NAMES[: loop.photos], ""),
            "etag": ETAGS[: loop.photos],
            "predicted_class": pa.array(answer_a.astype(str)),
            "confidence": first,
            "top_k_prob": pa.ListArray.from_arrays(offsets, pa.array(np.column_stack([first, second]).ravel())),
        }
    )
    shadow = pa.array(answer_b.astype(str))
    return night, shadow, truth, answer_a, answer_b


def passes_within(loop: Loop, nights: int, seed: int, policy: PairedTestPolicy | None = None) -> int | None:
    """The night (1-based) after which the gate first passed the challenger, or None within ``nights``."""
    rng = np.random.default_rng(seed)
    labelled_a: list[pa.Table] = []
    labelled_b: list[pa.Table] = []
    draws: list[queue.RandomDraw] = []
    for n in range(nights):
        dt = (FIRST_NIGHT + timedelta(days=n)).isoformat()
        night, shadow, truth, answer_a, answer_b = _night(loop, dt, rng)
        cfg = queue.QueueConfig(
            root="/unused", model_name=f"sim{seed}", dt=dt, budget=loop.budget, random_share=loop.random_share
        )
        queued, draw = queue.select(night, np.zeros(night.num_rows, dtype=bool), shadow, cfg)
        draws.append(draw)
        chosen = np.array([int(q.uri[-9:-4]) for q in queued])  # people label every queued photo: its truth
        labelled_a.append(_labelled(night, dt, chosen, answer_a, truth))
        labelled_b.append(_labelled(night, dt, chosen, answer_b, truth))
        no_declared = labels_table.LABELS_SCHEMA.empty_table()
        counted = None if loop.targeted_only else evidence.evidence(draws, no_declared, frozenset())
        test = paired.paired_test(pa.concat_tables(labelled_a), pa.concat_tables(labelled_b), 1, 2, policy, counted)
        if test.outcome == "passed":  # asked again every night: a test that failed once may pass later
            return n + 1
    return None


def _labelled(night: pa.Table, dt: str, chosen: np.ndarray, answers: np.ndarray, truth: np.ndarray) -> pa.Table:
    return pa.table(
        {
            "uri": night["uri"].take(chosen),
            "etag": night["etag"].take(chosen),
            "dt": [dt] * len(chosen),
            "predicted_index": answers[chosen],
            "label_index": truth[chosen],
        },
        schema=PREDICTED_SCHEMA,
    )
