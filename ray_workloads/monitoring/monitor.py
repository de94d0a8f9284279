"""Ops monitoring: serving health from the router's ``/stats``, drift of committed prediction partitions.

A partition's drift is judged against the champion's training label counts when it was trained here,
else (an outside model has no training data) the predicted classes of a reference night
(:func:`night_reference`): **class PSI** of the predicted-class shares (0.1 notable, 0.2 the usual alarm);
**low-confidence share**, predictions under ``low_confidence`` (images unlike anything the model was
trained on get flat scores); **error fraction**, inputs that could not be predicted at all.
Plain functions (no Prefect, no Ray): the monitor flow calls them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import BaseModel, Field

from rayline.errors import InputDataError
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.monitoring.charts import accuracy_png as accuracy_png  # the monitor's charts
from rayline.ray_workloads.monitoring.charts import distribution_png as distribution_png
from rayline.ray_workloads.monitoring.prometheus import prometheus_text as prometheus_text  # the monitor's file
from rayline.ray_workloads.monitoring.thresholds import DriftThresholds as DriftThresholds  # the request's too
from rayline.storage.layout import PREDICTIONS_TABLE, parse_day, table_uri
from rayline.tables.prediction_reads import committed_nights, read_night_pair


class VersionHealth(BaseModel):
    version: int
    weight: float
    requests: int
    errors: int
    error_rate: float
    p95_ms: float | None


class ServingHealth(BaseModel):
    url: str
    reachable: bool
    healthy: bool
    served: bool = True
    versions: list[VersionHealth] = Field(default_factory=list)
    problem: str | None = None
    stats_problem: str | None = Field(
        None, description="Why the per-version figures are missing (a rate-limited /stats): no data, not a fault."
    )
    champion: int | None = Field(None, description="The registry's champion, when checked against it.")
    champion_mismatch: bool = Field(False, description="Most traffic on another version, with no rollout under way.")


class Reference(BaseModel):
    """What a night's predicted classes are compared with."""

    kind: Literal["training labels", "reference night"]
    uri: str = Field(description="The training data manifest, or the predictions table of the reference night.")
    dt: str | None = Field(None, description="The reference night's day.")
    counts: dict[str, int]
    smoothing: float | None = Field(
        None, description="Pseudo-count per class for the PSI (reference nights); None: shares floored instead."
    )
    low_confidence_share: float | None = Field(
        None, description="The reference night's share of unsure predictions; None for training labels."
    )

    def describe(self) -> str:
        return self.kind if self.kind == "training labels" else f"reference night dt={self.dt}"


# Pseudo-count added to every class seen in either night (Jeffreys' prior): with 1,000 classes and a few
# hundred images a night, most classes are empty in one night or the other, and flooring empty shares at
# 1e-4 would make every such class count as a ~0.3 PSI jump on its own.
NIGHT_SMOOTHING = 0.5


class PartitionDrift(BaseModel):
    model_name: str
    dt: str
    version: int = Field(description="The predictions table's version of the night's commit.")
    model: str
    inputs: int
    predictions: int
    errors: int
    class_share: dict[str, float]
    reference_share: dict[str, float]
    psi: float
    mean_confidence: float
    low_confidence_share: float
    drifted: bool
    reasons: list[str]
    reference: str = "training labels"
    core_seconds: float | None = Field(None, description="CPU seconds the night's run took (its commit's record).")

    @property
    def error_fraction(self) -> float:
        return self.errors / self.inputs if self.inputs else 0.0

    @property
    def partition(self) -> str:
        return f"dt={self.dt}"

    @property
    def night(self) -> str:
        return f"{self.model_name}/dt={self.dt}"


def psi(reference: Mapping[str, float], actual: Mapping[str, float], floor: float = 1e-4) -> float:
    """Population-stability index over the union of categories (shares floored to stay finite)."""
    total = 0.0
    for key in set(reference) | set(actual):
        expected, seen = max(reference.get(key, 0.0), floor), max(actual.get(key, 0.0), floor)
        total += (seen - expected) * math.log(seen / expected)
    return total


def smoothed_psi(reference: Mapping[str, int], actual: Mapping[str, int], alpha: float) -> float:
    """PSI of two count tables with ``alpha`` added to each class seen in either: a class neither
    predicted only adds pseudo-counts that would drown a small night (1,000 × 0.5 against a few hundred)."""
    classes = set(reference) | set(actual)
    if not classes:
        return 0.0

    def smoothed(counts: Mapping[str, int]) -> dict[str, float]:
        total = sum(counts.get(c, 0) for c in classes) + alpha * len(classes)
        return {c: (counts.get(c, 0) + alpha) / total for c in classes}

    expected, seen = smoothed(reference), smoothed(actual)
    return sum((seen[c] - expected[c]) * math.log(seen[c] / expected[c]) for c in classes)


def shares(counts: Mapping[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in sorted(counts.items())} if total else {}


def serving_health(url: str, thresholds: DriftThresholds, model: str | None = None) -> ServingHealth:
    """The router's view of ``model`` (None: the default model): is a version taking traffic, how each answers.

    A model the router doesn't serve is reported as such, not as unhealthy. A ``/stats`` answered 429 is no
    data, not a fault (its budget is per client address, shared with any dashboard on the monitor's host):
    health is then judged by ``/healthz`` alone."""
    base = f"{url}/models/{model}" if model else url
    try:
        stats_response = httpx.get(f"{base}/stats", timeout=10)
        if stats_response.status_code == 404 and model:
            return ServingHealth(url=base, reachable=True, healthy=True, served=False, problem=f"{model} not served")
        limited = stats_response.status_code == 429
        stats = {} if limited else stats_response.raise_for_status().json()
        health = httpx.get(f"{base}/healthz", timeout=10)
    except httpx.HTTPError as exc:
        return ServingHealth(url=url, reachable=False, healthy=False, problem=f"{type(exc).__name__}: {exc}")
    versions = _version_health(stats)
    bad = [v for v in versions if v.weight > 0 and v.error_rate > thresholds.max_serving_error_rate]
    problem = None
    if health.status_code != 200:
        problem = f"/healthz answered {health.status_code}"
    elif bad:
        problem = ", ".join(f"v{v.version} error rate {v.error_rate:.1%}" for v in bad)
    stats_problem = None
    if limited:
        stats_problem = (
            f"/stats answered 429 (retry after {stats_response.headers.get('Retry-After', '?')} s): another "
            "client at this address spent the per-address budget; no per-version figures this time"
        )
    return ServingHealth(
        url=url,
        reachable=True,
        healthy=problem is None,
        versions=versions,
        problem=problem,
        stats_problem=stats_problem,
    )


def _version_health(stats: Mapping[str, Any]) -> list[VersionHealth]:
    weights = {int(v): float(w) for v, w in stats.get("weights", {}).items()}
    return [
        VersionHealth(
            version=int(v),
            weight=weights.get(int(v), 0.0),
            requests=int(s["requests"]),
            errors=int(s["errors"]),
            error_rate=s["errors"] / s["requests"] if s["requests"] else 0.0,
            p95_ms=s.get("p95_ms"),
        )
        for v, s in sorted(stats.get("versions", {}).items(), key=lambda kv: int(kv[0]))
    ]


def reference_for(champion: ModelVersion, root: str, reference_date: str | None, low_confidence: float) -> Reference:
    """What the champion's nights are judged against: its training label counts when it was trained here
    (and no reference date is named), else the predicted classes of ``reference_date``'s night or the model's
    first committed one: "has it changed since it started?" rather than "is it like what it learned from?"."""
    if reference_date is None and champion.data_manifest_uri is not None:
        counts = preprocess.read_manifest(champion.data_manifest_uri).class_counts["train"]
        return Reference(kind="training labels", uri=champion.data_manifest_uri, counts=dict(counts))
    dt = parse_day(reference_date, "reference_date").isoformat() if reference_date else None
    return night_reference(root, champion.name, dt, low_confidence)


def night_reference(root: str, model_name: str, dt: str | None, low_confidence: float) -> Reference:
    """The reference night of a model: ``dt`` if named, else its first committed night; its share of
    predictions under ``low_confidence`` is kept to judge later nights by."""
    if dt is None:
        nights = committed_nights(root, model_name)
        if not nights:
            raise InputDataError(
                f"no committed night of {model_name} to use as the reference: run nightly-inference "
                "first, or name a reference date"
            )
        dt = nights[-1]
    night = read_night_pair(root, model_name, dt)
    predictions = night.predictions
    if not predictions.num_rows:
        raise InputDataError(
            f"reference night {model_name} dt={dt} has no predictions to compare with (every input failed)"
        )
    confidence = np.asarray(predictions.column("confidence").to_pylist(), dtype=float)
    return Reference(
        kind="reference night",
        uri=table_uri(root, PREDICTIONS_TABLE),
        dt=dt,
        counts=dict(Counter(str(c) for c in predictions.column("predicted_class").to_pylist())),
        smoothing=NIGHT_SMOOTHING,
        low_confidence_share=float((confidence < low_confidence).mean()),
    )


def night_drift(
    root: str, model_name: str, dt: str, reference_counts: Mapping[str, int] | Reference, t: DriftThresholds
) -> PartitionDrift:
    """Compare one committed night's predictions with the reference (a plain mapping: training label
    counts, shares floored for the PSI)."""
    if not isinstance(reference_counts, Reference):
        reference_counts = Reference(kind="training labels", uri="", counts=dict(reference_counts))
    ref = reference_counts
    night = read_night_pair(root, model_name, dt)
    predictions, errors = night.predictions, night.errors
    classes = [str(c) for c in predictions.column("predicted_class").to_pylist()] if predictions.num_rows else []
    confidence = np.asarray(predictions.column("confidence").to_pylist() if predictions.num_rows else [], dtype=float)
    counts = Counter(classes)
    actual, reference = shares(counts), shares(ref.counts)
    if not actual:
        index = 0.0
    elif ref.smoothing is None:
        index = psi(reference, actual)
    else:
        index = smoothed_psi(ref.counts, counts, ref.smoothing)
    unsure = float((confidence < t.low_confidence).mean()) if confidence.size else 0.0
    inputs = predictions.num_rows + errors.num_rows
    reasons = []
    if index > t.psi:
        reasons.append(f"predicted-class PSI {index:.3f} > {t.psi}")
    # against a reference night: only more unsure than it was too (a 1,000-class model is often under 50 %
    # on photos it gets right; that is how it is, not a change)
    unsure_limit = max(t.max_low_confidence_share, ref.low_confidence_share or 0.0)
    if unsure > unsure_limit:
        than = "" if ref.low_confidence_share is None else f" (reference night {ref.low_confidence_share:.1%})"
        reasons.append(f"{unsure:.1%} of predictions under {t.low_confidence:.0%} confidence{than}")
    if inputs and errors.num_rows / inputs > t.max_error_fraction:
        reasons.append(f"error fraction {errors.num_rows / inputs:.1%} > {t.max_error_fraction:.1%}")
    models = set(predictions.column("model_version").to_pylist()) if predictions.num_rows else set()
    return PartitionDrift(
        model_name=model_name,
        dt=dt,
        version=night.commit.version,
        model=",".join(f"v{m}" for m in sorted(models)),
        inputs=inputs,
        predictions=predictions.num_rows,
        errors=errors.num_rows,
        class_share=actual,
        reference_share=reference,
        psi=index,
        mean_confidence=float(confidence.mean()) if confidence.size else 0.0,
        low_confidence_share=unsure,
        drifted=bool(reasons),
        reasons=reasons,
        reference=ref.describe(),
        core_seconds=night.commit.core_seconds,
    )
