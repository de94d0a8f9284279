"""Is the challenger better than the champion on the photos people labelled? A paired sequential test.

Only the photos where exactly one version is right carry evidence (McNemar's discordant pairs): a win for
the challenger, or a loss. Under "no better" a discordant photo is a win with probability 1/2; under
"better" with ``p_better`` (0.65). Wald's sequential probability ratio test sums each pair's log-likelihood
ratio: **passed** at log((1-beta)/alpha), **failed** at log(beta/(1-alpha)) (about ``beta`` = 20 % chance
of failing one better by the margin), **inconclusive** in between: the gate waits for more labels.

The test is re-run on all the labels whenever it is asked. The likelihood ratio is a supermartingale under
"no better", so however often it is looked at, a no-better challenger ever passes with probability at most
alpha/(1-beta) (Ville's inequality): 6.25 % by default, where a fixed-sample test looked at every night
would pass a coin flip sooner or later. That holds only for photos chosen whatever the versions answered:
:class:`Evidence` names the labels that may count. Agreement is not evidence: two versions that agree on
99 % of photos are judged on the other 1 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field

Outcome = Literal["passed", "failed", "inconclusive"]
Photo = tuple[str, str]  # (URI, ETag)


@dataclass(frozen=True)
class Evidence:
    """Which labelled photos may judge two versions: those chosen whatever their answers (``random``: a
    queue's random draw, or an import declared random) and trained on by neither (``trained_on``)."""

    random: frozenset[Photo]
    trained_on: frozenset[Photo] = field(default_factory=frozenset)


class PairedTestPolicy(BaseModel):
    p_better: float = Field(0.65, gt=0.5, lt=1, description="Share of discordant photos a better challenger wins.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="Chance of passing a challenger that is no better.")
    beta: float = Field(0.2, gt=0, lt=0.5, description="Chance of failing one better by the margin.")

    @property
    def upper(self) -> float:
        return math.log((1 - self.beta) / self.alpha)

    @property
    def lower(self) -> float:
        return math.log(self.beta / (1 - self.alpha))


class PairedTest(BaseModel):
    outcome: Outcome
    champion: int
    challenger: int
    paired: int = Field(description="Labelled photos both versions predicted.")
    challenger_wins: int = Field(description="Photos the challenger got right and the champion wrong.")
    champion_wins: int = Field(description="Photos the champion got right and the challenger wrong.")
    champion_accuracy: float | None
    challenger_accuracy: float | None
    agreement: float | None = Field(description="Share of the paired photos both predicted alike (not evidence).")
    targeted: int = Field(0, description="Paired photos left out: chosen by their answers, not at random.")
    trained_on: int = Field(0, description="Paired photos left out: a version (or its parent) trained on them.")
    log_likelihood_ratio: float
    upper: float
    lower: float
    policy: PairedTestPolicy

    def describe(self) -> str:
        acc = (
            f"accuracy v{self.challenger} {self.challenger_accuracy:.1%} vs v{self.champion} "
            f"{self.champion_accuracy:.1%} on {self.paired} labels chosen at random"
            if self.paired
            else f"0 labels chosen at random that both versions predicted{self._left_out()}"
        )
        return (
            f"{self.outcome}: {acc}; discordant {self.challenger_wins} won / {self.champion_wins} lost "
            f"(LLR {self.log_likelihood_ratio:+.2f}, pass at {self.upper:+.2f}, fail at {self.lower:+.2f})"
            f"{self._left_out() if self.paired else ''}"
        )

    def _left_out(self) -> str:
        parts = [f"{self.targeted} targeted"] if self.targeted else []
        parts += [f"{self.trained_on} trained on"] if self.trained_on else []
        return f" ({' and '.join(parts)} labels left out: not evidence, docs/quality.md)" if parts else ""


def sprt(challenger_wins: int, champion_wins: int, policy: PairedTestPolicy) -> tuple[Outcome, float]:
    """The outcome and log-likelihood ratio of these discordant pairs (it depends on the counts alone)."""
    llr = challenger_wins * math.log(policy.p_better / 0.5) + champion_wins * math.log((1 - policy.p_better) / 0.5)
    if llr >= policy.upper:
        return "passed", llr
    if llr <= policy.lower:
        return "failed", llr
    return "inconclusive", llr


def paired_test(
    champion_rows: pa.Table,
    challenger_rows: pa.Table,
    champion: int,
    challenger: int,
    policy: PairedTestPolicy | None = None,
    evidence: Evidence | None = None,
) -> PairedTest:
    """The test over the labelled photos both versions predicted that ``evidence`` counts (all: None). Each
    table holds one version's labelled predictions (``uri``, ``etag``, ``predicted_index``, ``label_index``,
    ``dt``): a photo predicted on several nights counts once, at its newest night."""
    policy = policy or PairedTestPolicy()
    a, b = _newest_per_photo(champion_rows), _newest_per_photo(challenger_rows)
    both = a.join(b, keys=["uri", "etag"], join_type="inner", left_suffix="_champion", right_suffix="_challenger")
    targeted = trained_on = 0
    if evidence is not None:
        random = holds(both, evidence.random)
        counted = pc.and_(random, pc.invert(holds(both, evidence.trained_on)))
        targeted = both.num_rows - int(pc.sum(random).as_py() or 0)
        trained_on = both.num_rows - targeted - int(pc.sum(counted).as_py() or 0)
        both = both.filter(counted)
    truth = both["label_index_champion"].to_numpy() if both.num_rows else np.array([], dtype=np.int64)
    right_a = both["predicted_index_champion"].to_numpy() == truth if both.num_rows else truth.astype(bool)
    right_b = both["predicted_index_challenger"].to_numpy() == truth if both.num_rows else truth.astype(bool)
    wins, losses = int((right_b & ~right_a).sum()), int((right_a & ~right_b).sum())
    outcome, llr = sprt(wins, losses, policy)
    n = both.num_rows
    same = (both["predicted_index_champion"].to_numpy() == both["predicted_index_challenger"].to_numpy()) if n else None
    return PairedTest(
        outcome=outcome,
        champion=champion,
        challenger=challenger,
        paired=n,
        challenger_wins=wins,
        champion_wins=losses,
        champion_accuracy=float(right_a.mean()) if n else None,
        challenger_accuracy=float(right_b.mean()) if n else None,
        agreement=float(same.mean()) if same is not None else None,
        targeted=targeted,
        trained_on=trained_on,
        log_likelihood_ratio=llr,
        upper=policy.upper,
        lower=policy.lower,
        policy=policy,
    )


def holds(rows: pa.Table, photos: frozenset[Photo]) -> pa.ChunkedArray | pa.Array:
    """Whether each row's (uri, etag) is one of ``photos``."""
    keys = pc.binary_join_element_wise(rows["uri"], rows["etag"], "\t")
    wanted = pa.array(sorted(f"{uri}\t{etag}" for uri, etag in photos), pa.string())
    return pc.is_in(keys, value_set=wanted)


def _newest_per_photo(rows: pa.Table) -> pa.Table:
    columns = ["uri", "etag", "predicted_index", "label_index"]
    if rows.num_rows == 0:
        return rows.select(columns)
    ranked = rows.sort_by([("dt", "descending")]).append_column("_i", pa.array(range(rows.num_rows), pa.int64()))
    first = ranked.group_by(["uri", "etag"], use_threads=False).aggregate([("_i", "min")])
    return ranked.filter(pc.is_in(ranked["_i"], value_set=first["_i_min"])).select(columns)
