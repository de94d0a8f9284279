"""A version's answers on a test split, image by image, and the paired comparison of two versions on one.

Two versions compared on the same images are judged by the images where exactly one of them is right (McNemar's
discordant pairs): the candidate right and the champion wrong is a *win*, the reverse a *loss*. Images both get right or
both get wrong say nothing about which is better. Under "the candidate is no better", a discordant image is a win with
probability at most 1/2, so the chance of seeing at least ``wins`` of ``wins + losses`` is at most the binomial tail
:func:`mcnemar_p`: the gate promotes a candidate no better than its champion at most ``alpha`` of the time.

Answers are a table of ``key``, ``etag`` (the image: the split's rows are matched on them, never on row order),
``label_index`` (the truth) and ``predicted_index``. A version keeps its answers under
``v<N>/predictions/<split digest>.parquet``: its own test split's, written at its registration, and those of each
candidate's split it was judged on, so a champion is evaluated once per split. The split digest is the set digest of
the images' (key, etag) pairs: the same images give the same name, whatever preprocessing folder or row order they
came from.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import InputDataError
from rayline.storage.digests import SetDigest
from rayline.storage.layout import PREDICTIONS_DIR
from rayline.storage.listing import content_digest

SCHEMA = pa.schema(
    [("key", pa.string()), ("etag", pa.string()), ("label_index", pa.int64()), ("predicted_index", pa.int64())]
)


class PairedCounts(BaseModel):
    """Two versions' answers on the same images: how many, and who was right where."""

    images: int = Field(ge=0, description="Images both versions answered.")
    both_right: int = Field(ge=0)
    wins: int = Field(ge=0, description="Images the candidate got right and the champion wrong.")
    losses: int = Field(ge=0, description="Images the champion got right and the candidate wrong.")

    @property
    def candidate_accuracy(self) -> float:
        return (self.both_right + self.wins) / self.images if self.images else 0.0

    @property
    def champion_accuracy(self) -> float:
        return (self.both_right + self.losses) / self.images if self.images else 0.0

    @property
    def p_value(self) -> float:
        return mcnemar_p(self.wins, self.losses)


def mcnemar_p(wins: int, losses: int) -> float:
    """Exact one-sided McNemar p-value: P(at least ``wins`` wins of ``wins + losses``) for a fair coin. Summed in
    log space (``lgamma``): exact to float precision for any count. No discordant image is no evidence (p = 1)."""
    n = wins + losses
    if wins <= 0:
        return 1.0
    half = n * math.log(2.0)
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) - half for k in range(wins, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * math.fsum(math.exp(value - top) for value in logs))


def answers_table(keys: np.ndarray, etags: np.ndarray, truth: np.ndarray, predicted: np.ndarray) -> pa.Table:
    """Answers in the stored form (one row an image)."""
    labels = [np.asarray(truth, dtype=np.int64), np.asarray(predicted, dtype=np.int64)]
    return pa.table([list(keys), list(etags), *labels], schema=SCHEMA)


def split_digest(answers: pa.Table) -> str:
    """``<images>-<hex>``: the set digest of the split's (key, etag) pairs, whatever their order."""
    keys, etags = answers.column("key").to_pylist(), answers.column("etag").to_pylist()
    return SetDigest.of(content_digest(k, e) for k, e in zip(keys, etags, strict=True)).encode().replace(":", "-")


def accuracy(answers: pa.Table) -> float:
    """Share of the images answered right."""
    if answers.num_rows == 0:
        return 0.0
    right = pc.equal(answers.column("label_index"), answers.column("predicted_index"))
    return float(int(pc.sum(right).as_py() or 0) / answers.num_rows)


def answers_uri(version_uri: str, digest: str) -> str:
    return storage.join(version_uri, PREDICTIONS_DIR, f"{digest}.parquet")


def store(version_uri: str, answers: pa.Table) -> str:
    """Keep ``answers`` with the version at ``version_uri``, named by their split's digest; returns the URI."""
    uri = answers_uri(version_uri, split_digest(answers))
    storage.write_parquet_atomic(uri, answers.select(SCHEMA.names).cast(SCHEMA))
    return uri


def read(version_uri: str, digest: str) -> pa.Table | None:
    """The version's answers on the split with ``digest``; None when it has not answered that split."""
    uri = answers_uri(version_uri, digest)
    return storage.read_parquet([uri], columns=SCHEMA.names) if storage.exists(uri) else None


def paired_counts(candidate: pa.Table, champion: pa.Table) -> PairedCounts:
    """Wins, losses and agreement of two versions on the candidate's images, matched by (key, etag). The champion
    must have answered them all: on part of the split, the images judged would be chosen by the champion's answers.
    """
    theirs = champion.select(["key", "etag", "predicted_index"]).rename_columns(["key", "etag", "champion_index"])
    both = candidate.select(SCHEMA.names).join(theirs, keys=["key", "etag"], join_type="inner")
    if both.num_rows != candidate.num_rows:
        raise InputDataError(
            f"the champion's answers cover {both.num_rows} of the candidate's {candidate.num_rows} test images: "
            "they cannot be compared image by image"
        )
    truth = both.column("label_index").to_numpy()
    mine = both.column("predicted_index").to_numpy() == truth
    its = both.column("champion_index").to_numpy() == truth
    return PairedCounts(
        images=both.num_rows,
        both_right=int((mine & its).sum()),
        wins=int((mine & ~its).sum()),
        losses=int((its & ~mine).sum()),
    )
