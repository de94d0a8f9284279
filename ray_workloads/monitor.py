"""Ops monitoring: serving health from the router's ``/stats``, drift of committed prediction partitions.

Drift of a partition is judged against the champion's training data:

* **class PSI** — population-stability index of the predicted-class shares vs
  the training label shares (0.1 notable, 0.2 the usual alarm);
* **low-confidence share** — predictions under ``low_confidence`` confidence:
  images unlike anything the model was trained on get flat scores;
* **error fraction** — inputs that could not be predicted at all.

Plain functions (no Prefect, no Ray): the monitor flow calls them, and the
Prometheus text they produce is what teams that scrape get.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

import httpx
import numpy as np
from pydantic import BaseModel, Field

from ray_workloads.batch_inference import MANIFEST, read_partition
from rayline import storage


class DriftThresholds(BaseModel):
    psi: float = Field(0.2, gt=0)
    low_confidence: float = Field(0.5, gt=0, lt=1, description="A prediction under this confidence is unsure.")
    max_low_confidence_share: float = Field(0.3, ge=0, le=1)
    max_error_fraction: float = Field(0.05, ge=0, le=1)
    max_serving_error_rate: float = Field(0.01, ge=0, le=1)


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
    versions: list[VersionHealth] = Field(default_factory=list)
    problem: str | None = None


class PartitionDrift(BaseModel):
    partition_uri: str
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

    @property
    def error_fraction(self) -> float:
        return self.errors / self.inputs if self.inputs else 0.0


def psi(reference: Mapping[str, float], actual: Mapping[str, float], floor: float = 1e-4) -> float:
    """Population-stability index over the union of categories (shares floored to stay finite)."""
    total = 0.0
    for key in set(reference) | set(actual):
        expected, seen = max(reference.get(key, 0.0), floor), max(actual.get(key, 0.0), floor)
        total += (seen - expected) * math.log(seen / expected)
    return total


def shares(counts: Mapping[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in sorted(counts.items())} if total else {}


def serving_health(url: str, thresholds: DriftThresholds) -> ServingHealth:
    """The router's view: is any version taking traffic, and how each one answers."""
    try:
        stats = httpx.get(f"{url}/stats", timeout=10).raise_for_status().json()
        health = httpx.get(f"{url}/healthz", timeout=10)
    except httpx.HTTPError as exc:
        return ServingHealth(url=url, reachable=False, healthy=False, problem=f"{type(exc).__name__}: {exc}")
    weights = {int(v): float(w) for v, w in stats.get("weights", {}).items()}
    versions = [
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
    bad = [v for v in versions if v.weight > 0 and v.error_rate > thresholds.max_serving_error_rate]
    problem = None
    if health.status_code != 200:
        problem = f"/healthz answered {health.status_code}"
    elif bad:
        problem = ", ".join(f"v{v.version} error rate {v.error_rate:.1%}" for v in bad)
    return ServingHealth(url=url, reachable=True, healthy=problem is None, versions=versions, problem=problem)


def committed_partitions(predictions_root: str, latest: int) -> list[str]:
    """The ``latest`` committed partitions (those with a manifest), newest first."""
    keys = {o.key.rsplit("/", 1)[0] for o in storage.list_objects(predictions_root) if o.key.endswith(MANIFEST)}
    return [storage.join(predictions_root, k) for k in sorted(keys, reverse=True)[:latest]]


def partition_drift(partition_uri: str, reference_counts: Mapping[str, int], t: DriftThresholds) -> PartitionDrift:
    """Compare one committed partition's predictions with the training label distribution."""
    predictions, errors = read_partition(partition_uri)
    classes = [str(c) for c in predictions.column("predicted_class").to_pylist()] if predictions.num_rows else []
    confidence = np.asarray(predictions.column("confidence").to_pylist() if predictions.num_rows else [], dtype=float)
    actual, reference = shares(Counter(classes)), shares(reference_counts)
    index = psi(reference, actual) if actual else 0.0
    unsure = float((confidence < t.low_confidence).mean()) if confidence.size else 0.0
    inputs = predictions.num_rows + errors.num_rows
    reasons = []
    if index > t.psi:
        reasons.append(f"predicted-class PSI {index:.3f} > {t.psi}")
    if unsure > t.max_low_confidence_share:
        reasons.append(f"{unsure:.1%} of predictions under {t.low_confidence:.0%} confidence")
    if inputs and errors.num_rows / inputs > t.max_error_fraction:
        reasons.append(f"error fraction {errors.num_rows / inputs:.1%} > {t.max_error_fraction:.1%}")
    models = set(predictions.column("model_version").to_pylist()) if predictions.num_rows else set()
    return PartitionDrift(
        partition_uri=partition_uri,
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
    )


def _labels(**labels: str) -> str:
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def prometheus_text(health: ServingHealth | None, drifts: list[PartitionDrift], flow_run: str) -> str:
    """Gauges in the Prometheus text exposition format, labelled by flow run, stage and model version."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{_labels(flow_run=flow_run, **labels)}}} {value:g}" for labels, value in samples)

    if health is not None:
        serve = {"stage": "serve"}
        metric("rayline_serve_up", "gauge", "1 when the router answers and some version takes traffic.",
               [(serve, float(health.healthy))])  # fmt: skip
        per_version = [({**serve, "model_version": str(v.version)}, v) for v in health.versions]
        metric("rayline_serve_requests_total", "counter", "Requests answered per version since the stats reset.",
               [(labels, v.requests) for labels, v in per_version])  # fmt: skip
        metric("rayline_serve_errors_total", "counter", "5xx answers per version since the stats reset.",
               [(labels, v.errors) for labels, v in per_version])  # fmt: skip
        metric("rayline_serve_weight", "gauge", "Traffic weight per version.",
               [(labels, v.weight) for labels, v in per_version])  # fmt: skip
    batch = [({"stage": "batch_inference", "model_version": d.model, "partition": _partition(d)}, d) for d in drifts]
    metric("rayline_predictions_rows", "gauge", "Prediction rows of a committed partition.",
           [(labels, d.predictions) for labels, d in batch])  # fmt: skip
    metric("rayline_predictions_error_fraction", "gauge", "Inputs of a partition that got an error row.",
           [(labels, d.error_fraction) for labels, d in batch])  # fmt: skip
    metric("rayline_predictions_class_psi", "gauge", "PSI of predicted classes vs the training labels.",
           [(labels, d.psi) for labels, d in batch])  # fmt: skip
    metric("rayline_predictions_low_confidence_share", "gauge", "Share of predictions under the confidence floor.",
           [(labels, d.low_confidence_share) for labels, d in batch])  # fmt: skip
    return "\n".join(lines) + "\n"


def _partition(drift: PartitionDrift) -> str:
    return drift.partition_uri.rstrip("/").rsplit("/", 1)[-1]


def distribution_png(drift: PartitionDrift) -> bytes:
    """Predicted-class shares of a partition next to the training label shares."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(set(drift.reference_share) | set(drift.class_share))
    x = np.arange(len(keys))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.bar(x - 0.2, [drift.reference_share.get(k, 0) for k in keys], 0.4, label="training labels")
    ax.bar(x + 0.2, [drift.class_share.get(k, 0) for k in keys], 0.4, label="predicted")
    ax.set_xticks(x, keys)
    ax.set_ylabel("share")
    ax.set_title(f"{_partition(drift)}: PSI {drift.psi:.3f}")
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
